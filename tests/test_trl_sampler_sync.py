"""The TRL drop-in's sampler-sync guard (`GRPOConfig(sampler_sync=...)`): off by default, as stock TRL; "stop" raises
`StaleSampler` from `compute_loss` (before the backward, so before the optimizer step) when the old and the sampler's
log-probs of a micro-batch differ by more than the limit, "warn" warns, and a sampler on the policy's weights passes
with the loss unchanged."""

import pytest
import torch

trl = pytest.importorskip("trl")

import tests.test_trl as base  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.trainer.sampler_sync import StaleSampler  # noqa: E402

tokenizer, model_path = base.tokenizer, base.model_path  # test_trl's fixtures


def trainer_and_inputs(monkeypatch, model_path, tokenizer, gap: float, **config):
    monkeypatch.setattr(trl, "GRPOConfig", drop_in.GRPOConfig)  # test_trl's `build` with the drop-in's config
    trainer = base.build(drop_in.GRPOTrainer, model_path(), tokenizer, **config)
    inputs = base.make_inputs(trainer)
    shifted = inputs["old_per_token_logps"] - gap * inputs["completion_mask"]  # the sampler's: off by `gap`
    return trainer, {**inputs, "sampling_per_token_logps": shifted}


@pytest.mark.parametrize("sampler_sync", ["off", "stop", "warn"])
def test_the_guard_stops_or_warns_only_when_asked(monkeypatch, model_path, tokenizer, sampler_sync):
    config = {} if sampler_sync == "off" else dict(sampler_sync=sampler_sync)
    trainer, inputs = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.5, **config)
    if sampler_sync == "stop":
        with pytest.raises(StaleSampler, match=r"^step 1: .* by 0\.5 nats per token on average .* did not reach it"):
            base.step(trainer, inputs)
    elif sampler_sync == "warn":
        with pytest.warns(UserWarning, match=r"^step 1: the sampler's log-probs"):
            base.step(trainer, inputs)
    else:
        base.step(trainer, inputs)


def test_a_sampler_on_the_policys_weights_passes_with_the_same_loss(monkeypatch, model_path, tokenizer):
    off, inputs = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.0)
    on, _ = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.0, sampler_sync="stop")
    (loss_off, grads_off, _), (loss_on, grads_on, _) = base.step(off, inputs), base.step(on, inputs)
    assert torch.equal(loss_on, loss_off) and grads_on.keys() == grads_off.keys()
    with pytest.raises(StaleSampler, match="the limit is 0.001"):  # fp32's limit, just above a 1e-3 gap
        base.step(*trainer_and_inputs(monkeypatch, model_path, tokenizer, 2e-3, sampler_sync="stop"))


def test_a_gap_rising_step_after_step_stops_below_the_limit(monkeypatch, model_path, tokenizer):
    """The trainer's trend rule over optimizer steps: gaps of 0.04, 0.1 and 0.25 under a limit of 0.5 rise twice,
    to over 2× the first, above a third of the limit; the third step stops. Two micro-batches a step: the step's
    mean is over both."""
    trainer, inputs = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.0, sampler_sync="stop",
                                         sampler_sync_tolerance=0.5)  # fmt: skip
    mask, old = inputs["completion_mask"], inputs["old_per_token_logps"]
    for step, gap in enumerate((0.04, 0.1, 0.25)):
        trainer.state.global_step = step
        shifted = {**inputs, "sampling_per_token_logps": old - gap * mask}
        if step < 2:
            base.step(trainer, shifted)
            base.step(trainer, shifted)
            continue
        with pytest.raises(StaleSampler, match=r"^step 3: .* under the limit 0\.5 but rising .* 0\.04 → 0\.1 → 0\.25"):
            base.step(trainer, shifted)


def test_steady_gaps_under_the_limit_do_not_stop(monkeypatch, model_path, tokenizer):
    trainer, inputs = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.2, sampler_sync="stop",
                                         sampler_sync_tolerance=0.5)  # fmt: skip
    for step in range(4):
        trainer.state.global_step = step
        base.step(trainer, inputs)

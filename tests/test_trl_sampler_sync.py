"""The TRL drop-in's sampler-sync guard (`GRPOConfig(sampler_sync=...)`): off by default, as stock TRL; "stop" raises
`StaleSampler` from `compute_loss` (before the backward, so before the optimizer step) when the old and the sampler's
log-probs of a micro-batch differ by more than the limit, "warn" warns, and a sampler on the policy's weights passes
with the loss unchanged."""

import json
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

import tests.test_trl as base  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.integrations.trl_sampler_sync import step_gaps  # noqa: E402
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


def _resumed(monkeypatch, model_path, tokenizer, checkpoint: Path | None, **config):
    """A new drop-in trainer at the start of training, as `train(resume_from_checkpoint=checkpoint)` sets it up:
    the checkpoint's trainer state and callback states (transformers' own readers), then the callbacks'
    `on_train_begin`."""
    trainer, inputs = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.0, sampler_sync="stop",
                                         sampler_sync_tolerance=0.5, **config)  # fmt: skip
    if checkpoint is None:
        trainer.state.global_step = 2
    else:
        trainer.state = transformers.TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        trainer._load_callback_state()  # a copy of each callback, when restore_callback_states_from_checkpoint
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    return trainer, inputs


@pytest.mark.parametrize("restore_callbacks", [False, True])
def test_a_resumed_run_goes_on_with_its_trend(monkeypatch, model_path, tokenizer, tmp_path, restore_callbacks):
    """Steps 1 and 2's gaps (0.04, 0.1) go into the checkpoint transformers writes after step 2, and a new trainer
    resumed from it stops at step 3's 0.25, as the run would have (also where transformers replaces the callbacks
    with restored copies); one that starts afresh does not."""
    trainer, inputs = trainer_and_inputs(monkeypatch, model_path, tokenizer, 0.0, sampler_sync="stop",
                                         sampler_sync_tolerance=0.5, output_dir=str(tmp_path),
                                         save_only_model=True)  # fmt: skip
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)  # as `train` does
    mask, old = inputs["completion_mask"], inputs["old_per_token_logps"]
    for step, gap in enumerate((0.04, 0.1)):
        trainer.state.global_step = step
        base.step(trainer, {**inputs, "sampling_per_token_logps": old - gap * mask})
    trainer.state.global_step = 2
    trainer._save_checkpoint(trainer.model, trial=None)  # what the training loop calls after step 2
    checkpoint = tmp_path / "checkpoint-2"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["StepGaps"]
    assert saved["attributes"]["finished"] == pytest.approx([0.04, 0.1])

    shifted = {**inputs, "sampling_per_token_logps": old - 0.25 * mask}
    restore = dict(restore_callback_states_from_checkpoint=restore_callbacks)
    resumed, _ = _resumed(monkeypatch, model_path, tokenizer, checkpoint, **restore)
    with pytest.raises(StaleSampler, match=r"^step 3: .* under the limit 0\.5 but rising .* 0\.04 → 0\.1 → 0\.25"):
        base.step(resumed, shifted)
    afresh, _ = _resumed(monkeypatch, model_path, tokenizer, None)
    base.step(afresh, shifted)
    assert step_gaps(afresh).latest() == pytest.approx([0.25])


@pytest.mark.parametrize("finished", [[float("nan")], [-0.1], ["0.1"], None])
def test_a_checkpoint_with_gaps_that_are_not_gaps_is_refused(monkeypatch, model_path, tokenizer, tmp_path, finished):
    state = transformers.TrainerState()
    state.stateful_callbacks = {"StepGaps": {"args": {}, "attributes": {"finished": finished}}}
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    with pytest.raises(ValueError, match=r"^trainer_state\.json: stateful_callbacks\.StepGaps\.attributes\.finished"):
        _resumed(monkeypatch, model_path, tokenizer, tmp_path)

"""The TRL drop-in without stock TRL's old-log-prob pass where only the vLLM correction needs it (μ = 1, one
generation per optimizer step): on the same samples (`benchmarks/trl_replay_bias.py`'s `rollout_func`, which returns
the sampler's log-probs as vLLM does), the loss, every gradient and every logged metric (the `sampling/*` ones
included) equal stock TRL 1.16's in each correction mode, and the policy runs one forward fewer. With truncated
sampling the reference is the drop-in with its old pass (stock TRL does not replay the truncation, so its ratio is
each token's kept mass: `tests/test_trl_replay.py`); the fused loss's own replay metrics, which TRL does not have,
are not logged without the old pass. With μ = 2 the pass runs, as in stock TRL."""

import pytest
import torch

trl = pytest.importorskip("trl")

from benchmarks import trl_replay_bias as bias  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.integrations import trl_one_pass  # noqa: E402
from tests.conftest import assert_close  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(bias.write_model(tmp_path_factory.mktemp("one_pass_model")))


def generate_and_update(
    model_dir: str, ours: bool, accumulation: int = 1, **config
) -> tuple[torch.Tensor, dict, dict, list[bool]]:
    """TRL's generation on the sampler's batch, then compute_loss and backward on each of `accumulation`
    micro-batches: (the summed loss, grads, the logged metrics, whether gradients were on at each forward of the
    policy's decoder outside the sampler)."""
    import datasets

    args = trl.GRPOConfig(
        output_dir=str(model_dir) + "-out",
        per_device_train_batch_size=len(bias.PROMPTS) // accumulation,
        gradient_accumulation_steps=accumulation,
        num_generations=2,
        max_completion_length=bias.LENGTH,
        temperature=bias.T_SAMPLE,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        **config,
    )
    chars = bias.tokenizer()
    dataset = datasets.Dataset.from_dict({"prompt": bias.PROMPTS})
    trainer = trl.GRPOTrainer(
        model_dir, reward_funcs=bias._length, args=args, train_dataset=dataset, processing_class=chars
    )
    sampler = bias.TruncatedSampler(chars, drop_in.trl_replay.sampling_rule(trainer.args))
    counting, forwards = [True], []

    def rollout(prompts, trainer):  # the sampler's own forwards are not counted
        counting[0] = False
        try:
            return sampler(prompts, trainer)
        finally:
            counting[0] = True

    trainer.rollout_func = rollout
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.args.use_vllm = True
    if ours:
        drop_in.patch(trainer)
    trainer._last_loaded_step = trainer.state.global_step  # no weight sync: there is no vLLM
    trainer.model.get_decoder().register_forward_hook(
        lambda *_: forwards.append(torch.is_grad_enabled()) if counting[0] else None
    )
    trainer.model.train()
    trainer._metrics["train"].clear()
    output = trainer._generate_and_score_completions([{"prompt": p} for p in bias.PROMPTS])
    trainer.current_gradient_accumulation_steps = accumulation
    rows = output["completion_ids"].shape[0]
    loss = 0.0
    for part in torch.arange(rows).chunk(accumulation):  # TRL's micro-batches of the generation batch
        micro = {k: v[part] if torch.is_tensor(v) and v.dim() and len(v) == rows else v for k, v in output.items()}
        micro_loss = trainer.compute_loss(trainer.model, micro)
        micro_loss.backward()
        loss = loss + micro_loss.detach()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss, grads, {name: values[-1] for name, values in trainer._metrics["train"].items()}, forwards


def assert_same(got: tuple, want: tuple) -> None:
    """The loss, every gradient and every logged metric (`generate_and_update`'s first three) equal."""
    (loss, grads, metrics), (want_loss, want_grads, want_metrics) = got[:3], want[:3]
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-6)  # near 0 where no ratio is masked
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert_close(grads[name], grad, torch.float32, f"grad {name}")
    expected = set(want_metrics) - set(drop_in.REPLAY_METRICS)  # the fused loss's own, not TRL's: not logged here
    assert set(metrics) == expected and "sampling/importance_sampling_ratio/mean" in metrics
    for name in expected:
        assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize(
    "mode, rule",
    [
        ("token_truncate", {}),
        ("token_mask", dict(top_k=5, top_p=0.9)),
        ("sequence_truncate", dict(top_k=5)),
        ("sequence_mask", {}),
    ],
)
def test_one_fewer_forward_and_the_two_pass_numbers(monkeypatch, model_dir, mode, rule):
    config = dict(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5, **rule)
    if rule:  # the drop-in with its old pass
        monkeypatch.setattr(trl_one_pass, "fuses_old_pass", lambda trainer: False)
    want_loss, want_grads, want_metrics, want_forwards = generate_and_update(model_dir, bool(rule), **config)
    monkeypatch.undo()
    loss, grads, metrics, forwards = generate_and_update(model_dir, True, **config)
    assert want_forwards == [False, True] and forwards == [True]  # the old pass, then the loss pass
    assert_same((loss, grads, metrics), (want_loss, want_grads, want_metrics))


def test_with_two_iterations_the_old_pass_runs(model_dir):
    *_, forwards = generate_and_update(model_dir, True, num_iterations=2)
    assert forwards == [False, True]


def test_two_micro_batches_log_the_generation_batchs_sampling_metrics(model_dir):
    """steps_per_generation = gradient_accumulation_steps = 2: the `sampling/*` metrics, logged at the second
    micro-batch, are stock TRL's over the whole generation batch; only stock TRL runs the old pass."""
    want = generate_and_update(model_dir, False, accumulation=2)
    got = generate_and_update(model_dir, True, accumulation=2)
    assert want[3] == [False, False, True, True] and got[3] == [True, True]  # TRL passes by micro-batch size
    assert_same(got, want)

"""The TRL drop-in's training phase against stock TRL 1.16 on the vLLM path with its importance-sampling correction on
(TRL's default): stock TRL runs a no-grad forward for `old_per_token_logps` (π_old = π_θ at μ = 1) before the loss;
the drop-in skips it and takes π_old, the ratio and the `sampling/*` metrics from its fused loss pass.

The policy is `benchmarks/trl_step.py`'s tiny Qwen2 (2 layers, V = 151,936 at the cpu size), fp32, dapo, β = 0 (no
reference pass). A TRL `rollout_func` stands in for vLLM: the same prompt and completion ids every call, with
log-probs near the policy's (−log V), as vLLM's sampler returns them. Timed: TRL's `_generate_and_score_completions`
on those completions (the stand-in generation, a zero reward, and stock's π_old pass) then `training_step` (the loss
forward and backward), once per round after a warm-up; the optimizer step is left out (the same code in both).
Providers: `stock` (the correction on), `stock_no_correction` (off: stock without its π_old pass, for the share of
the time that pass takes), `drop_in` (the correction on, one pass).

    python -m pytest -q benchmarks/bench_trl_one_pass.py --bench-size cpu -p no:cacheprovider
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import trl_step

PROVIDERS = ("stock", "stock_no_correction", "drop_in")


class FixedSampler:
    """A TRL `rollout_func`: the same B prompts and completions each call (seeded), with the sampler's log-probs."""

    def __init__(self, size: trl_step.StepSize) -> None:
        g = torch.Generator().manual_seed(0)
        self.prompt_ids = torch.randint(4, size.V, (size.B, size.prompt), generator=g).tolist()
        self.completion_ids = torch.randint(4, size.V, (size.B, size.T), generator=g).tolist()
        noise = 0.01 * torch.randn(size.B, size.T, generator=g)
        self.logprobs = (noise - math.log(size.V)).tolist()

    def __call__(self, prompts: list, trainer) -> dict:
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "logprobs": self.logprobs}


def build(provider: str, size: trl_step.StepSize, model_dir, output_dir):
    """Stock `trl.GRPOTrainer` (`trl_step.build_trainer`, β = 0) on the vLLM path, the sampler above standing in
    (no engine to sync), switched to the drop-in by `patch` for `drop_in`, as a vLLM run builds it."""
    from grpo_kernels.integrations import trl as drop_in

    trainer = trl_step.build_trainer("trl", size, model_dir, output_dir, loss={**trl_step.LOSS, "beta": 0.0})
    trainer.rollout_func = FixedSampler(size)
    trainer.use_vllm = trainer.args.use_vllm = True
    trainer.vllm_importance_sampling_correction = provider != "stock_no_correction"
    if provider == "drop_in":
        drop_in.patch(trainer)
    trainer._last_loaded_step = trainer.state.global_step  # no engine to push weights to
    trainer.model.train()
    return trainer


def training_phase(trainer, prompts: list[dict]) -> float:
    """Generation by the stand-in, scoring (and stock's π_old pass), then the loss's forward and backward."""
    inputs = trainer._generate_and_score_completions(prompts)
    loss = trainer.training_step(trainer.model, inputs, inputs["num_items_in_batch"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return loss.item()


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_trl_one_pass(benchmark, bench_size, provider, tmp_path):
    reason = trl_step.skip_reason("drop_in")
    if reason:
        pytest.skip(reason)
    if bench_size not in trl_step.SIZES:
        pytest.skip(f"trl_one_pass has sizes {sorted(trl_step.SIZES)}, not {bench_size}")
    if bench_size == "smoke" and provider == "stock_no_correction":
        pytest.skip("stock_no_correction only splits the measured time (cpu size); smoke checks the two others")
    size = trl_step.SIZES[bench_size]
    trainer = build(provider, size, trl_step.save_model(size, tmp_path / "model"), tmp_path / "out")
    prompts = [{"prompt": "ab"}] * size.B
    benchmark.extra_info.update(bench="trl_one_pass", provider=provider, size=bench_size, shape=size.name)
    no_grad_forwards: list[bool] = []  # the π_old pass is the model's only forward without gradients
    trainer.model.register_forward_hook(lambda *_: no_grad_forwards.append(not torch.is_grad_enabled()))
    rounds = 1  # after a warm-up: the cpu size takes minutes a call on a shared CPU
    benchmark.pedantic(
        training_phase,
        args=(trainer, prompts),
        setup=lambda: trl_step.reset(trainer),
        rounds=rounds,
        warmup_rounds=1,
    )
    calls = 1 if benchmark.disabled else rounds + 1  # the warm-up too
    assert sum(no_grad_forwards) == (calls if provider == "stock" else 0), "only stock's correction runs the π_old pass"
    assert len(no_grad_forwards) == calls * (2 if provider == "stock" else 1)

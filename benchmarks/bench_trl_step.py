"""One GRPOTrainer training step on a tiny Qwen2 with a V = 151,936 head, stock TRL 1.16 against the drop-in
`grpo_kernels.integrations.trl.GRPOTrainer` (the setup and the interleaved-rounds command: benchmarks/trl_step.py).
Floor: none timed (a whole model step); the head's GEMMs are the fused-linear bench's floor."""

import pytest

from benchmarks import trl_step


@pytest.mark.parametrize("provider", trl_step.PROVIDERS)
def bench_trl_step(benchmark, bench_size, provider, tmp_path):
    reason = trl_step.skip_reason(provider)
    if reason:
        pytest.skip(reason)
    if bench_size not in trl_step.SIZES:
        pytest.skip(f"trl_step has sizes {sorted(trl_step.SIZES)}, not {bench_size}")
    size = trl_step.SIZES[bench_size]
    model_dir = trl_step.save_model(size, tmp_path / "model")
    trainer = trl_step.build_trainer(provider, size, model_dir, tmp_path / "out")
    step = trl_step.step_fn(trainer, trl_step.batch(size, trainer.accelerator.device))
    benchmark.extra_info.update(trl_step.info(provider, bench_size))
    rounds = {"smoke": 1, "cpu": 2}[bench_size]
    benchmark.pedantic(step, setup=lambda: trl_step.reset(trainer), rounds=rounds, warmup_rounds=1)
    if not benchmark.disabled:
        median = benchmark.stats.stats.median
        benchmark.extra_info.update(median_s=median, tokens_per_s=size.N / median)
    if not benchmark.disabled and bench_size != "smoke":
        benchmark.extra_info["peak_extra_bytes"] = trl_step.peak_extra_bytes(provider, bench_size)

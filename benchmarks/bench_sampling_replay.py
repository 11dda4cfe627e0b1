"""Sampling replay on the fused lm_head + GRPO loss, forward + backward: the plain step, rule replay (top_k 1,024
with top_p 0.9; top_p 0.9), min-p 0.05 and kept-set replay, on the size's TRL case (the cases and the interleaved
ratio command: benchmarks/sampling_replay.py). Floor: the plain step of the same run."""

import pytest

from benchmarks import cases, sampling_replay


@pytest.mark.parametrize("case", list(sampling_replay.CASES))
def bench_sampling_replay(benchmark, bench_size, case):
    shape = sampling_replay.shape_of(bench_size)
    data = sampling_replay.inputs(shape)
    run = sampling_replay.step(case, shape, data)
    benchmark.extra_info.update(cases.case_info("sampling_replay", case, shape, "fwd_bwd", bench_size))
    rounds = {"smoke": 1, "cpu": 2}.get(bench_size, 5)
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=1)
    if not benchmark.disabled:
        median = benchmark.stats.stats.median
        benchmark.extra_info.update(median_s=median, tokens_per_s=shape.N / median)
    if not benchmark.disabled and bench_size != "smoke":
        benchmark.extra_info["peak_extra_bytes"] = sampling_replay.peak_extra_bytes(case, bench_size, shape, data)

"""The two-head distillation divergence, forward + backward from both models' hidden states: `fused_linear_divergence`
against TRL 1.16's `ChunkedDivergenceFunction` and Liger's `LigerFusedLinearJSD`, at beta 1 (TRL's default, reverse
KL) and 0.5 (JSD). Floor: the student's three GEMMs and the teacher's one (4·N·V·H multiply-adds); TRL's Function
runs 6 (8 for the JSD), recomputing both heads in its backward. Peak extra memory comes from a fresh process per
provider (`divergence_cases.measure_memory_in_fresh_process`); the gradients themselves (dW float32 [V, H], dH) are
part of every provider's peak."""

import pytest
import torch

from benchmarks import divergence_cases as cases


@pytest.mark.parametrize("beta", (1.0, 0.5))
@pytest.mark.parametrize("provider", cases.PROVIDERS)
def bench_divergence(benchmark, bench_size, provider, beta):
    size = bench_size if bench_size in cases.SIZES else "smoke"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = cases.skip_reason(provider, device)
    if reason:
        pytest.skip(reason)
    N, H, V = cases.SIZES[size]
    run = cases.step(provider, beta, cases.inputs(N, H, V, device))
    benchmark.extra_info.update(N=N, H=H, V=V, dtype="float32", beta=beta, provider=provider, device=str(device))
    benchmark.pedantic(run, rounds=3 if size.startswith("gpu") else 1, warmup_rounds=0)
    if not benchmark.disabled and size != "smoke":
        benchmark.extra_info["peak_extra_bytes"] = cases.measure_memory_in_fresh_process(provider, beta, N, H, V)
        benchmark.extra_info["gradient_bytes"] = 4 * (V * H + N * H)

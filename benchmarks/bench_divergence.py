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


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("memory", ("fast", "lean"))
def bench_divergence_memory(benchmark, bench_size, memory, dtype):
    """`fused_linear_divergence`'s two memory modes at the reverse KL, float32 and bf16 heads: "lean" trades 4 more
    GEMMs for no [rows, V] buffers and, with bf16 heads, no float32 [V, H] accumulator beside dW."""
    size = bench_size if bench_size in cases.SIZES else "smoke"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    N, H, V = cases.SIZES[size]
    run = cases.step("grpo_kernels", 1.0, cases.inputs(N, H, V, device, getattr(torch, dtype)), memory)
    benchmark.extra_info.update(N=N, H=H, V=V, dtype=dtype, beta=1.0, memory=memory, device=str(device))
    benchmark.pedantic(run, rounds=3 if size.startswith("gpu") else 1, warmup_rounds=0)
    if not benchmark.disabled and size != "smoke":
        peak = cases.measure_memory_in_fresh_process("grpo_kernels", 1.0, N, H, V, dtype, memory)
        benchmark.extra_info["peak_extra_bytes"] = peak
        benchmark.extra_info["gradient_bytes"] = getattr(torch, dtype).itemsize * (V * H + N * H)

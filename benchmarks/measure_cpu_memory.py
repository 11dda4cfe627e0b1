"""Time and extra peak RSS of one forward + backward, each provider in a fresh process (CPU).

    python -m benchmarks.measure_cpu_memory             # the logits-level loss (logits from hidden @ W.T)
    python -m benchmarks.measure_cpu_memory fused_linear  # the fused lm_head + loss, against Liger when installed

The extra peak is VmHWM after the step minus VmRSS before it (the peak reset in between; Linux).
The gradients' own size (grad_W + grad_hidden), the fused-linear floor, is printed beside it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import torch

from benchmarks.peak_memory import reset_peak_rss, status_kib

LOGITS_SHAPE = dict(B=4, T=256, V=151936, H=64)
FUSED_SHAPE = dict(B=8, T=256, V=151936, H=896)  # 78% of the tokens valid


def _inputs(B: int, T: int, V: int, H: int, keep: float):
    torch.manual_seed(0)
    hidden = torch.randn(B, T, H).requires_grad_()
    weight = (torch.randn(V, H) / H**0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) < keep
    adv = torch.randn(B)
    old = torch.randn(B, T) - 12
    return hidden, weight, targets, mask, adv, old, old + 0.1


def _step(case: str, provider: str, hidden, weight, targets, mask, adv, old, ref):
    import grpo_kernels as gk
    from benchmarks.baselines import liger_chunked_loss, naive_loss

    options = dict(loss_type="dapo", epsilon_high=0.28, beta=0.04)
    if provider == "naive":
        return naive_loss(hidden @ weight.T, targets, adv, old, ref, mask, **options)
    if provider == "liger":
        return liger_chunked_loss(hidden, weight, targets, adv, old, ref, mask, **options)
    if case == "fused_linear":
        return gk.fused_linear_grpo_loss(hidden, weight, targets, adv, old, ref, mask, **options).loss
    return gk.grpo_loss(hidden @ weight.T, targets, adv, old, ref, mask, **options).loss


def run(case: str, provider: str) -> None:
    shape = FUSED_SHAPE if case == "fused_linear" else LOGITS_SHAPE
    inputs = _inputs(**shape, keep=0.78 if case == "fused_linear" else 0.9)
    base = reset_peak_rss()
    start = time.perf_counter()
    _step(case, provider, *inputs).backward()
    seconds = time.perf_counter() - start
    extra = (status_kib("VmHWM") - base) / 2**20
    grads = sum(x.numel() for x in inputs[:2]) * 4 / 2**30
    print(
        f"{case} {shape} {provider}: {seconds:.2f} s, extra peak RSS {extra:.3f} GiB (grad_W + grad_hidden "
        f"{grads:.3f} GiB)",
        flush=True,
    )


def providers(case: str) -> list[str]:
    peers = ["liger"] if case == "fused_linear" and importlib.util.find_spec("liger_kernel") else []
    return ["naive", "grpo_kernels", *peers]


if __name__ == "__main__":
    case = sys.argv[1] if len(sys.argv) > 1 else "logits"
    if len(sys.argv) > 2:
        run(case, sys.argv[2])
    else:
        for provider in providers(case):
            subprocess.run([sys.executable, "-m", "benchmarks.measure_cpu_memory", case, provider], check=True)

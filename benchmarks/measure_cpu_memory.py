"""Time and extra peak RSS of one forward + backward, each provider in a fresh process (CPU).

`python -m benchmarks.measure_cpu_memory` prints one line per provider. The logits come out of `hidden @ W.T`,
as an lm_head's do, so the in-place gradient flows into the matmul backward; the extra peak is measured after
they exist.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import torch

B, T, V, H = 4, 256, 151936, 64


def run(provider: str) -> None:
    import grpo_kernels as gk
    from benchmarks.baselines import naive_grpo_loss

    torch.manual_seed(0)
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = (torch.randn(V, H) / 8).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.1
    adv = torch.randn(B)
    old = torch.randn(B, T) - 12
    ref = old + 0.1
    logits = hidden @ weight.T  # [B, T, V]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if provider == "naive":
        loss = naive_grpo_loss(logits, targets, adv, old, ref, mask)
    else:
        loss = gk.grpo_loss(logits, targets, adv, old, ref, mask, loss_type="dapo", epsilon_high=0.28, beta=0.04).loss
    loss.backward()
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20  # ru_maxrss is in KiB on Linux
    print(f"{provider}: {seconds:.2f} s, extra peak RSS {extra:.3f} GiB beyond {B * T * V * 4 / 2**30:.2f} GiB logits")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for provider in ("naive", "grpo_kernels"):
            subprocess.run([sys.executable, "-m", "benchmarks.measure_cpu_memory", provider], check=True)

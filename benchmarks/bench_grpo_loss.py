"""grpo_loss forward + backward (logits in), against the eager TRL-style loss.

Floor: the logits are read twice (forward, backward) and the gradient written once: 3·N·V·itemsize bytes.
Peak extra memory is measured on CUDA (max_memory_allocated delta); CPU runs record time only.
"""

from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from benchmarks.baselines import naive_grpo_loss
from benchmarks.shapes import shapes_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROVIDERS = ("grpo_kernels", "naive") + (("grpo_kernels_triton",) if DEVICE.type == "cuda" else ())


def _inputs(shape):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(shape.B, shape.T, shape.V, generator=g, device=DEVICE).to(shape.dtype)
    targets = torch.randint(0, shape.V, (shape.B, shape.T), generator=g, device=DEVICE)
    mask = torch.rand(shape.B, shape.T, generator=g, device=DEVICE) > 0.1
    adv = torch.randn(shape.B, generator=g, device=DEVICE)
    logp = gk.token_logprobs(logits, targets)
    return logits, targets, adv, logp - 0.1, logp + 0.1, mask


def _step(provider, logits, targets, adv, old, ref, mask):
    logits = logits.detach().requires_grad_()
    if provider == "naive":
        loss = naive_grpo_loss(logits, targets, adv, old, ref, mask)
    else:
        backend = "triton" if provider == "grpo_kernels_triton" else "auto"
        loss = gk.grpo_loss(
            logits, targets, adv, old, ref, mask, loss_type="dapo", epsilon_high=0.28, beta=0.04, backend=backend
        ).loss
    loss.backward()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("shape", shapes_for(DEVICE), ids=lambda s: s.name)
@pytest.mark.parametrize("provider", PROVIDERS)
def bench_grpo_loss_fwd_bwd(benchmark, provider, shape):
    inputs = _inputs(shape)
    benchmark.extra_info.update(
        device=str(DEVICE),
        shape=shape.name,
        B=shape.B,
        T=shape.T,
        V=shape.V,
        dtype=str(shape.dtype),
        torch=torch.__version__,
    )
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(provider, *inputs)
        benchmark.extra_info["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    benchmark.pedantic(_step, args=(provider, *inputs), rounds=3, warmup_rounds=1)

"""The rollout correction's cost: the fused lm_head + loss step (forward + backward) with the heaviest correction
(sequence rejection, IcePop, batch normalisation, every metric) against the plain loss step, at the TRL comparison's
case (`shapes.TRL_CASES`); and the `[B, T]` correction alone against verl 0.9.1's `rollout_corr_helper` on the same
tensors, with each one's host syncs counted (`extra_info["host_syncs"]`). Compare medians within one run."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk
from benchmarks.shapes import TRL_CASES
from grpo_kernels.losses.mismatch import rollout_correction
from grpo_kernels.rollout_correction import RolloutCorrection

HEAVIEST = dict(
    rollout_is="token",
    rollout_is_threshold="0.5_2.0",
    rollout_is_batch_normalize=True,
    rollout_rs="seq_mean_k3,seq_max_k2,token_k1",
    rollout_rs_threshold="0.05,0.3,0.4_2.5",
)
ROUNDS = {"smoke": 1, "cpu": 3, "gpu": 10}
CORRECTION_SHAPE = {"smoke": (4, 64), "cpu": (64, 1024), "gpu": (256, 4096)}  # [B, T]
SYNC_OPS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero}


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (`.item()`, `bool()`, `float()`)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in SYNC_OPS
        return func(*args, **(kwargs or {}))


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("provider", ("plain", "heaviest"))
def bench_mismatch_step(benchmark, bench_size, provider):
    shape = TRL_CASES[bench_size]
    g = torch.Generator().manual_seed(0)
    B, T = shape.B, shape.T
    dev = _device()
    hidden = (torch.randn(B, T, shape.H, generator=g) / shape.H**0.5).to(dev, shape.dtype).requires_grad_()
    weight = (torch.randn(shape.V, shape.H, generator=g) / shape.H**0.5).to(dev, shape.dtype).requires_grad_()
    targets = torch.randint(0, shape.V, (B, T), generator=g).to(dev)
    old = (-torch.rand(B, T, generator=g) * 3 - 9).to(dev)
    sampling = old + 0.1 * torch.randn(B, T, generator=g).to(dev)
    advantages = torch.randn(B, generator=g).to(dev)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    keywords = dict(loss_type="dapo", beta=0.0, check_finite=False)
    if provider == "heaviest":
        keywords.update(sampling_logp=sampling, rollout_correction=RolloutCorrection(**HEAVIEST))

    def step():
        hidden.grad = weight.grad = None
        gk.fused_linear_grpo_loss(hidden, weight, targets, advantages, old, None, mask, **keywords).loss.backward()
        if dev == "cuda":
            torch.cuda.synchronize()

    benchmark.extra_info.update(shape=shape.name, provider=provider)
    benchmark.pedantic(step, rounds=ROUNDS[bench_size], warmup_rounds=1)


@pytest.mark.parametrize("provider", ("grpo_kernels", "verl"))
def bench_mismatch_correction(benchmark, bench_size, provider):
    B, T = CORRECTION_SHAPE[bench_size]
    g = torch.Generator().manual_seed(1)
    dev = _device()
    old = (-torch.rand(B, T, generator=g) * 3).to(dev)
    sampling = old + 0.1 * torch.randn(B, T, generator=g).to(dev)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)).to(dev)
    if provider == "verl":
        helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
        float_mask = mask.float()

        def step():
            return helper.compute_rollout_correction_and_rejection_mask(old, sampling, float_mask, **HEAVIEST)

    else:
        correction = RolloutCorrection(**HEAVIEST)

        def step():
            return rollout_correction(old, sampling, mask, correction)

    with _HostSyncs() as syncs:
        step()
    benchmark.extra_info.update(shape=f"B{B}-T{T}", provider=provider, host_syncs=syncs.count)
    benchmark.pedantic(step, rounds=ROUNDS[bench_size] * 10, warmup_rounds=1)

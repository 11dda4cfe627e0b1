"""Shared test plumbing: the loss inputs of a case, and our loss next to the float64 oracle's."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels.backend import CAPABILITIES
from grpo_kernels.losses.epilogue import fits_kernel_epilogue, is_token_level
from grpo_kernels.options import LossOptions
from tests.cases import Case, make_inputs

# Triton under its CPU interpreter (~1 s a launch): the matrix tests run a representative subset of their Triton
# cells there (each test names its rule), and every cell where Triton compiles.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def backend_cells(backends: tuple[str, ...], full: list[tuple], interpreted: Callable[[], list[tuple]]) -> list[tuple]:
    """(backend, *cell) for each backend: every cell of `full`, but Triton under its interpreter runs `interpreted()`
    (the test's representative subset)."""
    return [
        (backend, *cell)
        for backend in backends
        for cell in (interpreted() if backend == "triton" and TRITON_INTERPRETED else full)
    ]


def quiet_options(**options) -> LossOptions:
    """LossOptions without its warnings: cells are chosen at collection, and each cell's own call warns where due."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LossOptions(**options)


def kernel_forms_loss(backend: str, **options) -> bool:
    """Whether grpo_loss forms this loss in `backend`'s forward-kernel epilogue: engine/plan.py's `choose_route` for
    padded logits taking a gradient, no per-sequence losses asked and no weight taking a gradient (the callers'
    checks of the launch counter keep this in step with the engine)."""
    caps = CAPABILITIES[backend]
    opts = quiet_options(**options)
    return caps.epilogue_module is not None and is_token_level(opts) and fits_kernel_epilogue(opts, caps.epilogue_kl)


def first_of_each(cells: list[tuple]) -> list[tuple]:
    """The (a, b) cells that bring a new a or a new b, in order: each loss type and each variant at least once."""
    kept, seen_a, seen_b = [], set(), set()
    for a, b in cells:
        if a not in seen_a or b not in seen_b:
            kept.append((a, b))
            seen_a.add(a)
            seen_b.add(b)
    return kept


def interpreted_cells(cells: list[tuple], fused: Callable[..., bool]) -> list[tuple]:
    """Of a matrix's (loss type, variant) cells, those Triton runs under its interpreter: every cell whose loss the
    Triton kernel forms itself (`fused`), and of the two-phase cells the first of each loss type and the first of each
    variant no kept cell has yet. A two-phase cell runs Triton's plain vocabulary pass and then the PyTorch loss
    algebra, which is backend-independent and checked on every cell by the torch backend: the rest would only repeat
    the same pass."""
    covered = {variant for loss_type, variant in cells if fused(loss_type, variant)}
    kept, types = [], set()
    for loss_type, variant in cells:
        if fused(loss_type, variant):
            kept.append((loss_type, variant))
        elif loss_type not in types or variant not in covered:
            kept.append((loss_type, variant))
            types.add(loss_type)
            covered.add(variant)
    return kept


def oracle_logits(logits: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy for the reference, with the NaN that poison masked rows replaced by 0."""
    x = logits.detach().double().cpu()
    return torch.where(torch.isnan(x), torch.zeros_like(x), x).requires_grad_()


def loss_inputs(case: Case, dtype: torch.dtype, device, seed: int = 0, per_token_advantages: bool = False) -> dict:
    """Inputs of grpo_loss: the case's logits/targets/mask plus advantages, and old/ref log-probs near the
    current ones (ratios spread around 1, some outside the clip range)."""
    inputs = make_inputs(case, dtype, device, seed)
    if case.name == "extreme_logits":
        # At |logits| ~ 1e4 a random target has |logp| ~ 1e4, which float32 holds only to ~1e-3, and the ratio
        # exp(logp − old) inherits that; sampled tokens are the probable ones, so take the argmax instead.
        inputs["targets"] = inputs["logits"].nan_to_num(0.0).argmax(-1)
    g = torch.Generator().manual_seed(seed + 1)
    B, T = inputs["mask"].shape
    with torch.no_grad():
        logp, _ = reference.token_logprobs(
            oracle_logits(inputs["logits"]), inputs["targets"].cpu(), temperature=case.temperature
        )
    adv_shape = (B, T) if per_token_advantages else (B,)
    inputs["advantages"] = torch.randn(adv_shape, generator=g).to(device)
    inputs["old_logp"] = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float().to(device)
    # ref at least 0.2 away: k3 ≈ d²/2 has float32 relative error ≈ 2·eps·|logp|/|d| from logp's own rounding,
    # so a tiny d would measure float32 rounding of the inputs rather than the kernel.
    d = torch.randn(B, T, generator=g, dtype=torch.float64)
    inputs["ref_logp"] = (logp + d.sign() * (0.2 + 0.3 * d.abs())).float().to(device)
    return inputs


def ours_and_oracle(inputs: dict, backend: str, temperature: float = 1.0, with_entropy: bool = True, **options):
    """(loss, metrics, logits grad) of grpo_loss and of reference.grpo_loss on the same inputs."""
    args = {k: inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")}
    extra = {k: inputs[k] for k in ("is_ratio",) if k in inputs}
    ref_logits = oracle_logits(inputs["logits"])  # before the in-place backward overwrites the logits
    logits = inputs["logits"].detach().requires_grad_()
    out = gk.grpo_loss(
        logits, **args, **extra, temperature=temperature, backend=backend, with_entropy=with_entropy, **options
    )
    out.loss.backward()
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in {**args, **extra}.items()}
    ref_loss, ref_metrics = reference.grpo_loss(ref_logits, **cpu, temperature=temperature, **options)
    ref_loss.backward()
    return (out.loss, out.metrics, logits.grad), (ref_loss, ref_metrics, ref_logits.grad)

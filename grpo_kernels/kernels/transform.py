"""The logit transform z = c·tanh(s·x/c) / T (TRL's order: scale, soft-cap, temperature) and its chain rule dz/dx,
on any device's tensors: the backends and the replayed pass share them, and no backend-neutral module imports a
backend for them."""

from __future__ import annotations

import torch
from torch import Tensor


def transform_(z: Tensor, temperature: float, logit_scale: float, softcap: float | None) -> Tensor:
    """In place on a compute-dtype buffer: z ← s·z, then c·tanh(z/c) when soft-capped, then z/T (TRL's order)."""
    if softcap is not None:
        return z.mul_(logit_scale / softcap).tanh_().mul_(softcap / temperature)
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    return z.div_(temperature) if temperature != 1.0 else z


def slope(x: Tensor, temperature: float, logit_scale: float, softcap: float | None) -> Tensor:
    """dz/dx of `transform_` at raw logits x, float32: s/T, or s/T·sech²(s·x/c) when soft-capped."""
    constant = logit_scale / temperature
    if softcap is None:
        return torch.full_like(x, constant, dtype=torch.float32)
    return constant / torch.cosh(x.float() * (logit_scale / softcap)).square()


def chain_rule_(grad: Tensor, x: Tensor, *, mask: Tensor, temperature: float, logit_scale: float,
                softcap: float | None, buffer: Tensor) -> Tensor:  # fmt: skip
    """grad [C, V] ← dL/dx from dL/dz in place, x [C, V] the raw logits, mask [C] the kept rows (a soft-capped
    row that is masked may hold NaN logits: its 0 stays 0); `buffer` [C, V] in grad's dtype holds sech²."""
    constant = logit_scale / temperature
    if softcap is not None:
        sech2 = buffer.copy_(x).mul_(logit_scale / softcap)
        grad.mul_(sech2.cosh_().square_().reciprocal_().mul_(constant))  # 1/cosh², not 1 − tanh² (cancels near ±1)
        grad.masked_fill_(~mask[:, None], 0.0)
    elif constant != 1.0:
        grad.mul_(constant)
    return grad

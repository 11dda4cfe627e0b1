"""The two-head divergence on one chunk of rows, in PyTorch ops: both heads' logits `[c, V]` in, per-row divergence,
student entropy and log-prob out, and dD/dx of the student's logits written over the student's chunk.

Everything after the two logits buffers runs on vocabulary blocks of `block` columns, so the only `[c, V]` tensors are
the two buffers the caller owns (each holds a head's log-probs after `_log_softmax_`, the student's then its gradient).
Forward and reverse KL and the generalized JSD follow `reference_divergence`; their gradients in z_s:
- forward KL: p_s − p_t;
- reverse KL: p_s·(log p_s − log p_t − D);
- JSD: (1 − beta)·p_s·(log p_s − log m − KL(p_s || m)).
Multiplied by dz/dx = s·(1 − tanh²)/T (softcap c, scale s, temperature T). A product whose probability is 0 is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Head:
    """One head's logit transform before the shared temperature: z = c·tanh(s·x/c)."""

    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None


def _blocks(vocab: int, block: int):
    for start in range(0, vocab, block):
        yield slice(start, min(start + block, vocab))


def transform_(x: Tensor, head: Head, temperature: float) -> None:
    """x ← c·tanh(s·x/c) / T, in place."""
    if head.logit_scale != 1.0:
        x.mul_(head.logit_scale)
    if head.final_logit_softcapping is not None:
        x.div_(head.final_logit_softcapping).tanh_().mul_(head.final_logit_softcapping)
    if temperature != 1.0:
        x.div_(temperature)


def logsumexp(z: Tensor, block: int) -> Tensor:
    """lse(z) `[c, 1]` over the last dimension, with temporaries one block wide."""
    top = z.amax(-1, keepdim=True)  # [c, 1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of -inf (or inf) keeps its lse
    total = torch.zeros_like(top)
    for cols in _blocks(z.shape[-1], block):
        total += (z[:, cols] - top).exp_().sum(-1, keepdim=True)
    return top + total.log()  # [c, 1]


def log_softmax_(z: Tensor, block: int) -> Tensor:
    """z ← z − lse(z) in place; returns lse `[c, 1]`."""
    lse = logsumexp(z, block)
    z.sub_(lse)
    return lse


def entropy_of(log_p: Tensor, block: int) -> Tensor:
    """−Σ p log p `[c]` of log-probs `[c, V]`."""
    entropy = log_p.new_zeros(log_p.shape[0])
    for cols in _blocks(log_p.shape[1], block):
        ls = log_p[:, cols]
        entropy -= weighted(ls.exp(), ls.clone()).sum(-1)
    return entropy


def weighted(p: Tensor, log_ratio: Tensor) -> Tensor:
    """p · log_ratio, 0 where p is 0 (0·log 0 = 0), in log_ratio's storage when it is a temporary."""
    return log_ratio.mul_(p).masked_fill_(p == 0, 0.0)


def zs_derivative(log_ps: Tensor, lse: Tensor, head: Head, temperature: float) -> Tensor | float:
    """dz/dx on a block of the student's logits, from its log-probs (z = log p + lse)."""
    factor = head.logit_scale / temperature
    cap = head.final_logit_softcapping
    if cap is None:
        return factor
    th = (log_ps + lse).mul_(temperature / cap)  # tanh(s·x/c)
    return th.square_().neg_().add_(1.0).mul_(factor)


def divergence_chunk(
    zs: Tensor,
    zt: Tensor,
    targets: Tensor | None,
    *,
    beta: float,
    temperature: float,
    student: Head,
    teacher: Head,
    with_grad: bool,
    block: int = 8192,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """(divergence, entropy, logp of `targets` or None, student lse, teacher lse), `[c]` each, from the raw logits
    zs, zt `[c, V]` (overwritten: zs with dD/dx_s when `with_grad`, else with the student's log-probs)."""
    transform_(zs, student, temperature)
    transform_(zt, teacher, temperature)
    lse_s, lse_t = log_softmax_(zs, block), log_softmax_(zt, block)  # zs, zt now log p_s, log p_t
    logp = None if targets is None else zs.gather(1, targets[:, None])[:, 0]
    rows = zs.shape[0]
    entropy, divergence, kl_student = entropy_of(zs, block), zs.new_zeros(rows), zs.new_zeros(rows)
    log_mix = (math.log1p(-beta), math.log(beta)) if 0.0 < beta < 1.0 else None
    for cols in _blocks(zs.shape[1], block):
        ls, lt = zs[:, cols], zt[:, cols]
        ps = ls.exp()
        if beta == 0.0:
            pt = lt.exp()
            divergence += weighted(pt, lt - ls).sum(-1)
            if with_grad:
                derivative = zs_derivative(ls.clone(), lse_s, student, temperature)
                torch.sub(ps, pt, out=ls).mul_(derivative)
        elif beta == 1.0:
            divergence += weighted(ps, ls - lt).sum(-1)
        else:
            log_m = torch.logaddexp(ls + log_mix[0], lt + log_mix[1])
            divergence += beta * weighted(lt.exp(), lt - log_m).sum(-1)
            kl_student += weighted(ps, ls - log_m).sum(-1)
    if 0.0 < beta < 1.0:
        divergence += (1 - beta) * kl_student
    if with_grad and beta > 0.0:
        _student_gradient_(zs, zt, beta, log_mix, divergence if beta == 1.0 else kl_student,
                           lse_s, student, temperature, block)  # fmt: skip
    return divergence, entropy, logp, lse_s[:, 0], lse_t[:, 0]


def _student_gradient_(zs, zt, beta, log_mix, centre, lse_s, student, temperature, block) -> None:
    """zs (log p_s) ← dD/dx_s for reverse KL (`centre` = D) or the JSD (`centre` = KL(p_s || m)), block by block."""
    centre = centre[:, None]  # [c, 1]
    for cols in _blocks(zs.shape[1], block):
        ls, lt = zs[:, cols], zt[:, cols]
        derivative = zs_derivative(ls.clone(), lse_s, student, temperature)
        if beta == 1.0:
            grad = weighted(ls.exp(), (ls - lt).sub_(centre))
        else:
            log_m = torch.logaddexp(ls + log_mix[0], lt + log_mix[1])
            grad = weighted(ls.exp(), (ls - log_m).sub_(centre)).mul_(1 - beta)
        ls.copy_(grad.mul_(derivative))

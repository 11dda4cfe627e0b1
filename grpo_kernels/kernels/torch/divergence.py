"""The two-head divergence on one chunk of rows, in PyTorch ops: both heads' logits `[c, V]` in, per-row divergence,
student entropy and log-prob out, and dD/dx of the student's logits written over the student's chunk.

Everything after the two logits buffers runs on vocabulary blocks of `block` columns, so the only `[c, V]` tensors are
the two buffers the caller owns (each becomes its head's log-probs, the student's then its gradient).
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


@dataclass(frozen=True)
class ChunkSpec:
    """What a backend's chunk pass (`divergence_chunk`) computes, one record for every backend: the divergence
    (`beta`: 0 forward KL, 1 reverse KL, else the generalized JSD), the temperature shared by both heads, each head's
    transform, whether the student's gradient is written, and the vocabulary columns per elementwise block."""

    beta: float
    temperature: float = 1.0
    student: Head = Head()
    teacher: Head = Head()
    with_grad: bool = False
    block: int = 32768


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
    parts = [torch.logsumexp(z[:, cols], -1) for cols in _blocks(z.shape[-1], block)]
    return torch.logsumexp(torch.stack(parts, -1), -1, keepdim=True)  # [c, 1]


def log_softmax_(z: Tensor, block: int) -> Tensor:
    """z ← z − lse(z) in place; returns lse `[c, 1]`."""
    lse = logsumexp(z, block)
    z.sub_(lse)
    return lse


def has_neg_inf(*xs: Tensor) -> bool:
    """Whether any of the tensors holds -inf (then 0·log 0 products need masking)."""
    return any(x.numel() and bool(torch.isneginf(x.amin())) for x in xs)


def weighted(p: Tensor, log_ratio: Tensor, exact: bool = False) -> Tensor:
    """p · log_ratio in log_ratio's storage (a temporary), 0 where p is 0 (0·log 0 = 0) unless `exact` says no
    log ratio is infinite (then the product is 0 there already)."""
    log_ratio.mul_(p)
    return log_ratio if exact else log_ratio.masked_fill_(p == 0, 0.0)


def weighted_sum(p: Tensor, log_ratio: Tensor, exact: bool) -> Tensor:
    """Σ_v p·log_ratio per row `[c]` (log_ratio a temporary): one fused dot product per row when `exact`."""
    if exact:
        return torch.bmm(p[:, None, :], log_ratio[:, :, None])[:, 0, 0]
    return weighted(p, log_ratio).sum(-1)


def entropy_of(log_p: Tensor, block: int, exact: bool) -> Tensor:
    """−Σ p log p `[c]` of log-probs `[c, V]`."""
    entropy = log_p.new_zeros(log_p.shape[0])
    for cols in _blocks(log_p.shape[1], block):
        ls = log_p[:, cols]
        entropy -= weighted_sum(ls.exp(), ls if exact else ls.clone(), exact)
    return entropy


def zs_derivative(log_ps: Tensor, lse: Tensor, head: Head, temperature: float) -> Tensor | float:
    """dz/dx on a block of the student's logits, from its log-probs (z = log p + lse)."""
    factor = head.logit_scale / temperature
    cap = head.final_logit_softcapping
    if cap is None:
        return factor
    th = (log_ps + lse).mul_(temperature / cap)  # tanh(s·x/c)
    return th.square_().neg_().add_(1.0).mul_(factor)


def _row_statistics(z: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """(lse `[c, 1]`, the smallest value (a 0-d tensor)) of z, one cache-sized block at a time."""
    lses, lows = [], []
    for cols in _blocks(z.shape[1], block):
        zb = z[:, cols]
        lses.append(torch.logsumexp(zb, -1))
        lows.append(zb.amin())
    return torch.logsumexp(torch.stack(lses, -1), -1, keepdim=True), torch.stack(lows).amin()


def divergence_chunk(
    zs: Tensor, zt: Tensor, targets: Tensor | None, spec: ChunkSpec
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """(divergence, entropy, logp of `targets` or None, student lse, teacher lse), `[c]` each, from the raw logits
    zs, zt `[c, V]` (overwritten: zs with dD/dx_s when `spec.with_grad`, else with the student's log-probs).

    Up to three sweeps over the vocabulary, each block's work done while it is in cache: the two heads' log-sum-exps;
    the divergence and entropy (zs, zt become log p_s, log p_t; the forward KL's gradient is written here too); the
    gradient of the reverse KL or the JSD, which needs the row's divergence first."""
    beta, temperature, student, block, with_grad = spec.beta, spec.temperature, spec.student, spec.block, spec.with_grad
    transform_(zs, student, temperature)
    transform_(zt, spec.teacher, temperature)
    (lse_s, low_s), (lse_t, low_t) = _row_statistics(zs, block), _row_statistics(zt, block)
    exact = not bool(torch.isneginf(torch.minimum(low_s, low_t)))  # no -inf: no 0·log 0 to mask
    logp = None if targets is None else zs.gather(1, targets[:, None])[:, 0] - lse_s[:, 0]
    sums = DivergenceSums.zeros(zs.shape[0], zs)
    for cols in _blocks(zs.shape[1], block):
        ls, lt = zs[:, cols].sub_(lse_s), zt[:, cols].sub_(lse_t)
        ps, pt = sums.fold(ls, lt, beta, exact)
        if with_grad and beta == 0.0:  # the forward KL's gradient needs no row sum: written in this sweep
            derivative = zs_derivative(ls, lse_s, student, temperature)
            _scale_(torch.sub(ps, pt, out=ls), derivative)
    divergence, centre = sums.finish(beta)
    if with_grad and beta > 0.0:
        student_gradient_(zs, zt, centre=centre, lse_s=lse_s, spec=spec, exact=exact)
    return divergence, sums.entropy, logp, lse_s[:, 0], lse_t[:, 0]


def log_mixture(beta: float) -> tuple[float, float] | None:
    """(log(1 − beta), log beta) of the JSD's mixture m = (1 − beta)·p_s + beta·p_t, None for the two KLs."""
    return (math.log1p(-beta), math.log(beta)) if 0.0 < beta < 1.0 else None


@dataclass
class DivergenceSums:
    """A row's running sums `[c]` over vocabulary blocks: the entropy, the divergence so far (the teacher's side for
    the JSD) and the JSD's KL(p_s || m)."""

    entropy: Tensor
    divergence: Tensor
    kl_student: Tensor

    @classmethod
    def zeros(cls, rows: int, like: Tensor) -> DivergenceSums:
        return cls(*(like.new_zeros(rows) for _ in range(3)))

    def fold(self, ls: Tensor, lt: Tensor, beta: float, exact: bool) -> tuple[Tensor, Tensor | None]:
        """Add a block of log p_s, log p_t `[c, w]` (kept as they are); returns (p_s, p_t) of the forward KL, (p_s,
        None) of the others."""
        ps, pt = ls.exp(), None
        self.entropy -= weighted_sum(ps, ls if exact else ls.clone(), exact)
        if beta == 0.0:
            pt = lt.exp()
            self.divergence += weighted_sum(pt, lt - ls, exact)
        elif beta == 1.0:
            self.divergence += weighted_sum(ps, ls - lt, exact)
        else:
            log_1mb, log_b = log_mixture(beta)
            log_m = torch.logaddexp(ls + log_1mb, lt + log_b)
            self.divergence += beta * weighted_sum(lt.exp(), lt - log_m, exact)
            self.kl_student += weighted_sum(ps, ls - log_m, exact)
        return ps, pt

    def finish(self, beta: float) -> tuple[Tensor, Tensor]:
        """(the divergence `[c]`, the centre of the student's gradient: the divergence, or the JSD's KL(p_s || m))."""
        if 0.0 < beta < 1.0:
            return self.divergence + (1 - beta) * self.kl_student, self.kl_student
        return self.divergence, self.divergence


def student_gradient_(zs: Tensor, zt: Tensor, *, centre: Tensor, lse_s: Tensor, spec: ChunkSpec, exact: bool) -> None:
    """zs (log p_s, given zt = log p_t) ← dD/dx_s, block by block: (p_s − p_t) for the forward KL, p_s·(log p_s −
    log p_t − D) for the reverse KL, (1 − beta)·p_s·(log p_s − log m − KL(p_s || m)) for the JSD (`centre` = D or
    KL(p_s || m)), times dz/dx."""
    beta, student, temperature = spec.beta, spec.student, spec.temperature
    centre, log_mix = centre[:, None], log_mixture(beta)  # [c, 1]
    for cols in _blocks(zs.shape[1], spec.block):
        ls, lt = zs[:, cols], zt[:, cols]
        derivative = zs_derivative(ls, lse_s, student, temperature)
        ps = ls.exp()
        if beta == 0.0:
            torch.sub(ps, lt.exp(), out=ls)
        elif beta == 1.0:
            weighted(ps, ls.sub_(lt).sub_(centre), exact)
        else:
            log_m = torch.logaddexp(ls + log_mix[0], lt + log_mix[1])
            weighted(ps, ls.sub_(log_m).sub_(centre), exact)
            derivative = derivative * (1 - beta)
        _scale_(ls, derivative)


def _scale_(grad: Tensor, derivative: Tensor | float) -> None:
    """grad ← grad · dz/dx (nothing to do for a derivative of 1)."""
    if isinstance(derivative, Tensor) or derivative != 1.0:
        grad.mul_(derivative)

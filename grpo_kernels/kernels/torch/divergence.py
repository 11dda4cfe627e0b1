"""The two-head divergence on one chunk of rows, in PyTorch ops: both heads' logits `[c, V]` in, per-row divergence,
student entropy and log-prob out, and dD/dx of the student's logits written over the student's chunk.

Everything after the two logits buffers runs on vocabulary blocks of `block` columns, so the only `[c, V]` tensors are
the two buffers the caller owns (each becomes its head's log-probs, the student's then its gradient).
Forward and reverse KL and the generalized JSD follow `reference_divergence`; their gradients in z_s:
- forward KL: p_s − p_t;
- reverse KL: p_s·(log p_s − log p_t − D);
- JSD: (1 − beta)·p_s·(log p_s − log m − KL(p_s || m)).
Multiplied by dz/dx = s·(1 − tanh²)/T (softcap c, scale s, temperature T). A product whose probability is 0 is 0.

A token-level loss on the student's own log-probs may share the sweeps (`token_loss`, the GRPO loss of a step with a
teacher term): it reads the row's logp of `targets` and entropy once the second sweep has them, and its gradient
g·(onehot − p_s) − g_H·p_s·(log p_s + H) joins the divergence's in the last sweep, so the student's logits are swept
once for both losses (the forward KL's gradient then moves to that sweep too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


@dataclass(frozen=True)
class TokenGradient:
    """A token-level loss's gradients on a chunk's student rows, `[c]` each: dL/dlogp of `targets` and dL/dentropy
    (None: 0), and the divergence's row weights (None: 1). The gradient sweep writes
    weight·dD/dz + grad_logp·(onehot − p_s) − grad_entropy·p_s·(log p_s + H), times dz/dx."""

    targets: Tensor
    grad_logp: Tensor | None
    grad_entropy: Tensor | None
    weight: Tensor | None = None


TokenLoss = Callable[[Tensor, Tensor], TokenGradient]  # (logp of the targets, entropy) [c] -> its gradients


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


def log_softmax_(z: Tensor) -> Tensor:
    """z ← z − lse(z) in place, rows whole (torch's fused kernel: three reads and a write, no temporary; a blocked
    logsumexp and a subtraction took 2.7× as long on CPU); returns lse `[c, 1]`, as the row's max minus its largest
    log-prob (≥ −log V, so the difference is exact to rounding; two `amax` reads cost less than one `max` with
    its indices on the CPU)."""
    top = z.amax(-1, keepdim=True)  # [c, 1]
    torch.log_softmax(z, -1, out=z)
    return top - z.amax(-1, keepdim=True)


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


def divergence_chunk(
    zs: Tensor, zt: Tensor, targets: Tensor | None, spec: ChunkSpec, *, token_loss: TokenLoss | None = None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """(divergence, entropy, logp of `targets` or None, student lse, teacher lse), `[c]` each, from the raw logits
    zs, zt `[c, V]` (overwritten: zs with dD/dx_s when `spec.with_grad`, else with the student's log-probs).

    Up to three sweeps over the vocabulary, the last two a block at a time while it is in cache: the two heads'
    log-softmaxes (zs, zt become log p_s, log p_t, in place); the divergence and entropy (the forward KL's gradient is
    written here too); the gradient of the reverse KL or the JSD, which needs the row's divergence first.
    `token_loss` (with `targets`): called once with the rows' logp and entropy, its `TokenGradient` added in the last
    sweep."""
    beta, temperature, student, block, with_grad = spec.beta, spec.temperature, spec.student, spec.block, spec.with_grad
    transform_(zs, student, temperature)
    transform_(zt, spec.teacher, temperature)
    lse_s, lse_t = log_softmax_(zs), log_softmax_(zt)
    exact = not has_neg_inf(zs, zt)  # no -inf: no 0·log 0 to mask
    logp = None if targets is None else zs.gather(1, targets[:, None])[:, 0]
    sums = DivergenceSums.zeros(zs.shape[0], zs)
    for cols in _blocks(zs.shape[1], block):
        ls, lt = zs[:, cols], zt[:, cols]
        ps, pt = sums.fold(ls, lt, beta, exact)
        if with_grad and beta == 0.0 and token_loss is None:  # no row sum needed: the gradient is written here
            derivative = zs_derivative(ls, lse_s, student, temperature)
            _scale_(torch.sub(ps, pt, out=ls), derivative)
    divergence, centre = sums.finish(beta)
    token = None if token_loss is None else token_loss(logp, sums.entropy)
    if with_grad and (beta > 0.0 or token is not None):
        sweep = GradientSweep(beta, centre, lse_s, student, temperature, exact, token, sums.entropy)
        sweep.run_(zs, zt, block)
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


@dataclass(frozen=True)
class GradientSweep:
    """The last sweep: zs (log p_s, given zt = log p_t) ← dL/dx_s block by block. dD/dz_s is (p_s − p_t) for the
    forward KL, p_s·(log p_s − log p_t − D) for the reverse KL, (1 − beta)·p_s·(log p_s − log m − KL(p_s || m)) for
    the JSD (`centre` = D or KL(p_s || m)); a shared `token` loss adds its weighted sum (`TokenGradient`, formed as
    one expression per block: `_RowCoefficients`); times dz/dx. zt is scratch to it."""

    beta: float
    centre: Tensor  # [c]
    lse_s: Tensor  # [c, 1]
    student: Head
    temperature: float
    exact: bool  # no -inf logit: no 0·log 0 to mask
    token: TokenGradient | None = None
    entropy: Tensor | None = None  # [c]: the student's, read by a token loss's dL/dentropy

    def run_(self, zs: Tensor, zt: Tensor, block: int) -> None:
        beta, centre, log_mix = self.beta, self.centre[:, None], log_mixture(self.beta)  # [c, 1]
        rows = None if self.token is None else _RowCoefficients.of(self)
        for cols in _blocks(zs.shape[1], block):
            ls, lt = zs[:, cols], zt[:, cols]
            derivative = zs_derivative(ls, self.lse_s, self.student, self.temperature)
            ps = ls.exp()
            if rows is not None:
                rows.gradient_(ls, lt, ps, log_mix, self.exact, self.token.targets, cols)
            elif beta == 0.0:
                torch.sub(ps, lt.exp(), out=ls)
            elif beta == 1.0:
                weighted(ps, ls.sub_(lt).sub_(centre), self.exact)
            else:
                log_m = torch.logaddexp(ls + log_mix[0], lt + log_mix[1])
                weighted(ps, ls.sub_(log_m).sub_(centre), self.exact)
                derivative = derivative * (1 - beta)
            _scale_(ls, derivative)


@dataclass(frozen=True)
class _RowCoefficients:
    """weight·dD/dz_s + g·(onehot − p_s) − g_H·p_s·(log p_s + H) as p_s·(u·log p_s − a·X − c0) + g·onehot, with
    X = log p_t (reverse KL) or log m (JSD), and p_s·(u·log p_s − c0) − a·p_t for the forward KL: per-row `[c, 1]`
    a = weight (times 1 − beta for the JSD), u = a − g_H (−g_H for the forward KL; None: no log p_s term),
    c0 = a·centre + g + g_H·H (g + g_H·H − a for the forward KL)."""

    beta: float
    a: Tensor
    u: Tensor | None
    c0: Tensor
    grad_logp: Tensor | None

    @classmethod
    def of(cls, sweep: GradientSweep) -> _RowCoefficients:
        column = lambda x: None if x is None else x[:, None]  # noqa: E731
        a, u, c0, g = row_coefficients(sweep.token, sweep.beta, sweep.centre, sweep.entropy)
        a_column = a[:, None]
        return cls(sweep.beta, a_column, a_column if u is a else column(u), c0[:, None], column(g))

    def gradient_(self, ls, lt, ps, log_mix, exact: bool, targets: Tensor, cols: slice) -> None:
        """A block's log p_s `ls` ← its dL/dz_s (lt, the block's log p_t, is overwritten)."""
        beta, a, u, c0 = self.beta, self.a, self.u, self.c0
        if beta == 0.0:
            if u is None:
                torch.mul(ps, -c0, out=ls)
            else:
                weighted(ps, ls.mul_(u).sub_(c0), exact)
            ls.sub_(lt.exp_().mul_(a))
        else:
            other = lt if beta == 1.0 else torch.logaddexp(ls + log_mix[0], lt + log_mix[1])  # log p_t or log m
            if u is a:  # no dL/dentropy: a·(log p_s − X) − c0
                ls.sub_(other).mul_(a)
            else:
                ls.mul_(u).sub_(other.mul_(a))
            weighted(ps, ls.sub_(c0), exact)
        if self.grad_logp is not None:
            local = targets[:, None] - cols.start  # [c, 1]: the target's column in this block
            inside = (local >= 0) & (local < ls.shape[1])
            ls.scatter_add_(1, local.clamp(0, ls.shape[1] - 1), torch.where(inside, self.grad_logp, 0.0).to(ls.dtype))


def row_coefficients(
    token: TokenGradient, beta: float, centre: Tensor, entropy: Tensor
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """The per-row (a, u, c0, g) `[c]` of `_RowCoefficients` (its docstring has the formulas; g = dL/dlogp) from a
    token loss's gradients, the rows' `centre` and student entropy: the one source of the torch and Triton gradient
    sweeps' coefficients. u is a itself when the loss has no dL/dentropy (and beta > 0)."""
    a = torch.ones_like(centre) if token.weight is None else token.weight.to(centre.dtype)
    a = a * (1 - beta) if 0.0 < beta < 1.0 else a
    c0 = -a if beta == 0.0 else a * centre
    u = None if beta == 0.0 else a
    if token.grad_logp is not None:
        c0 = c0 + token.grad_logp
    if token.grad_entropy is not None:
        c0 = c0 + token.grad_entropy * entropy
        u = -token.grad_entropy if u is None else u - token.grad_entropy
    return a, u, c0, token.grad_logp


def student_gradient_(zs: Tensor, zt: Tensor, *, centre: Tensor, lse_s: Tensor, spec: ChunkSpec, exact: bool) -> None:
    """zs (log p_s, given zt = log p_t) ← dD/dx_s, block by block (`GradientSweep` without a token loss)."""
    GradientSweep(spec.beta, centre, lse_s, spec.student, spec.temperature, exact).run_(zs, zt, spec.block)


def _scale_(grad: Tensor, derivative: Tensor | float) -> None:
    """grad ← grad · dz/dx (nothing to do for a derivative of 1)."""
    if isinstance(derivative, Tensor) or derivative != 1.0:
        grad.mul_(derivative)

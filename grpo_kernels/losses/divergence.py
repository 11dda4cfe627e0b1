"""Policy terms held near the old policy by a divergence instead of PPO's ratio clip: DPPO's binary TV and KL
trust regions (arXiv:2602.04879) and DRO's quadratic log-ratio penalty (arXiv:2405.19107; Kimi k1.5,
arXiv:2501.12599). `policy.py` registers them.

DPPO's abstract: the ratio of one sampled token is a noisy estimate of the policy's divergence, over-penalising
low-probability tokens and under-constraining high-probability ones; DPPO masks the tokens whose update leaves a
trust region measured by a divergence, approximated on the binary distribution {token, rest}. The paper's text
beyond its abstract could not be read: the forms follow verl 0.9.1's `dppo_tv` / `dppo_kl` (see
`tests/test_verl.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.losses.terms import TokenTerms
from grpo_kernels.options import LossOptions

BINARY_KL_EPS = 1e-8  # guards log(1 − p) as p → 1 in the binary KL (verl's constant)


def binary_kl(terms: TokenTerms) -> Tensor:
    """KL(Bern(p_old) ‖ Bern(p)) of the sampled token's probability, p = e^logp: the divergence of the binary
    distribution {token, every other token}, [B, T]."""
    p, p_old = terms.logp.exp(), terms.old_logp.exp()  # [B, T]
    rest = ((1 - p_old + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS)).log()  # [B, T]
    return p_old * (terms.old_logp - terms.logp) + (1 - p_old) * rest


@torch.no_grad()
def dppo_inside(terms: TokenTerms, options: LossOptions) -> tuple[Tensor, Tensor]:
    """(inside for A > 0, inside for A ≤ 0), [B, T] bool: whether the token's move stays in DPPO's trust region.

    dppo_tv: the binary TV |p − p_old| bounds the move up by ε_high (A > 0 raises p) and down by ε_low.
    dppo_kl: the binary KL bounds it by ε_high where p rose and by ε_low where p fell; a move against A's push is
    always inside. Thresholds are `epsilon` (ε_low) and `epsilon_high` (ε_high; None: `epsilon`).
    """
    p, p_old = terms.logp.exp(), terms.old_logp.exp()  # [B, T]
    if options.loss_type == "dppo_tv":
        return p - p_old <= options.clip_high, p - p_old >= -options.epsilon
    kl = binary_kl(terms)  # [B, T]
    return (kl <= options.clip_high) | (p <= p_old), (kl <= options.epsilon) | (p >= p_old)


def dppo_keep(terms: TokenTerms, options: LossOptions) -> Tensor:
    """True where the token's update is inside the trust region on the side its advantage pushes, [B, T]."""
    up, down = dppo_inside(terms, options)
    return torch.where(terms.advantages > 0, up, down)


def dppo_flags(terms: TokenTerms, options: LossOptions, ratio: Tensor) -> tuple[Tensor, Tensor]:
    """(low, high): the tokens DPPO masks, with A ≤ 0 and with A > 0."""
    outside = ~dppo_keep(terms, options)  # [B, T]
    pushed_up = terms.advantages > 0
    return outside & ~pushed_up, outside & pushed_up


def dppo_weight(terms: TokenTerms, options: LossOptions) -> Tensor:
    """The truncated IS weight min(ρ, clip_ratio_c), detached (no cap when clip_ratio_c is None), [B, T] or [B, 1]."""
    ratio = terms.ratio if options.clip_ratio_c is None else terms.ratio.clamp(max=options.clip_ratio_c)
    return ratio.detach()


def _dppo(terms: TokenTerms, options: LossOptions) -> Tensor:
    keep = dppo_keep(terms, options).to(terms.logp.dtype)  # [B, T]
    return -terms.advantages * dppo_weight(terms, options) * terms.logp * keep


def dppo_tv(terms: TokenTerms, options: LossOptions) -> Tensor:
    """DPPO-Binary-TV: −sg(min(ρ, c))·A·logp where the token's probability moved by at most ε_high up (A > 0) or
    ε_low down (A ≤ 0), else 0; c = `clip_ratio_c`, [B, T]."""
    return _dppo(terms, options)


def dppo_kl(terms: TokenTerms, options: LossOptions) -> Tensor:
    """DPPO-Binary-KL: −sg(min(ρ, c))·A·logp where KL(Bern(p_old) ‖ Bern(p)) ≤ ε_high (A > 0, p rose) or ≤ ε_low
    (A ≤ 0, p fell), else 0; c = `clip_ratio_c`, [B, T]."""
    return _dppo(terms, options)


def dro(terms: TokenTerms, options: LossOptions) -> Tensor:
    """−(A·logp − ½β(logp − old_logp)²), β = `dro_beta`: REINFORCE with a quadratic penalty on the log-ratio, no
    clip (the log-ratio is not clamped: nothing is exponentiated), [B, T]."""
    return -(terms.advantages * terms.logp - 0.5 * options.dro_beta * terms.token_log_ratio.square())

"""Per-token policy terms of the GRPO family, and their registry (loss type -> term, normaliser, paper).

Each term maps TokenTerms to the per-token loss to minimise, [B, T] or [B, 1]; autograd differentiates it.
A new variant is one decorated function here (a KL estimator goes in kl.py, a normaliser in aggregate.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels.losses.terms import TokenTerms
from grpo_kernels.options import LossOptions

PolicyTerm = Callable[[TokenTerms, LossOptions], Tensor]
ClipFlags = Callable[[TokenTerms, LossOptions], tuple[Tensor, Tensor]]


def trust_region_flags(terms: TokenTerms, options: LossOptions) -> tuple[Tensor, Tensor]:
    """(low, high): where the ratio (after any `delta` cap) leaves [1 − ε_low, 1 + ε_high] against A's sign."""
    ratio = terms.ratio if options.delta is None else terms.ratio.clamp(max=options.delta)
    low = (ratio < 1 - options.epsilon_low) & (terms.advantages < 0)
    high = (ratio > 1 + options.clip_high) & (terms.advantages > 0)
    return low, high


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss type: its per-token term, its normaliser (aggregate.NORMALISERS) and its source."""

    name: str
    term: PolicyTerm
    normaliser: str
    paper: str
    clip_flags: ClipFlags = trust_region_flags
    absorbs_is_ratio: bool = False  # the term uses `is_ratio` itself instead of being multiplied by it
    epilogue: str | None = None  # the fused Triton epilogue computing this term at token level (None: two-phase)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def policy_loss(name: str, *, normaliser: str, paper: str, **fields) -> Callable[[PolicyTerm], PolicyTerm]:
    """Register a per-token policy term under a loss-type name."""

    def register(term: PolicyTerm) -> PolicyTerm:
        POLICY_LOSSES[name] = PolicyLoss(name, term, normaliser, paper, **fields)
        return term

    return register


def clipped_surrogate(terms: TokenTerms, options: LossOptions) -> Tensor:
    """PPO clip: −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A); with `delta`, the unclipped ρ is capped at δ."""
    ratio = terms.ratio  # [B, T] or [B, 1]
    clipped = ratio.clamp(1 - options.epsilon_low, 1 + options.clip_high)
    if options.delta is not None:
        ratio = ratio.clamp(max=options.delta)
    return -torch.min(ratio * terms.advantages, clipped * terms.advantages)


@policy_loss("grpo", normaliser="sequence_mean", paper="DeepSeekMath, arXiv:2402.03300", epilogue="clip")
def grpo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped surrogate, each sequence's token mean, then the mean over sequences."""
    return clipped_surrogate(terms, options)


@policy_loss("bnpo", normaliser="token_mean", paper="BNPO (TRL), token mean of the local batch", epilogue="clip")
def bnpo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped surrogate, mean over the batch's tokens."""
    return clipped_surrogate(terms, options)


@policy_loss("dr_grpo", normaliser="constant_length", paper="Dr. GRPO, arXiv:2503.20783", epilogue="clip")
def dr_grpo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped surrogate over the constant B · max_completion_length: no length bias."""
    return clipped_surrogate(terms, options)


@policy_loss("dapo", normaliser="item_mean", paper="DAPO, arXiv:2503.14476", epilogue="clip")
def dapo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped surrogate (clip-higher via epsilon_high) over the global token count."""
    return clipped_surrogate(terms, options)


@policy_loss("luspo", normaliser="sequence_sum_mean", paper="LUSPO, arXiv:2602.05261", epilogue="clip")
def luspo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped (sequence-level) surrogate, each sequence's token sum: GSPO scaled by length."""
    return clipped_surrogate(terms, options)


def _cispo_flags(terms: TokenTerms, options: LossOptions) -> tuple[Tensor, Tensor]:
    high = (terms.ratio > options.clip_high) & (terms.advantages > 0)
    return torch.zeros_like(high), high


@policy_loss(
    "cispo", normaliser="item_mean", paper="MiniMax-M1, arXiv:2506.13585", clip_flags=_cispo_flags, epilogue="cispo"
)
def cispo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """REINFORCE with a capped, stop-gradient IS weight: −sg(min(ρ, ε_high))·A·logp (TRL: ε_high is the cap)."""
    weight = terms.ratio.clamp(max=options.clip_high).detach()  # [B, T] or [B, 1]
    return -weight * terms.advantages * terms.logp


@policy_loss("sapo", normaliser="sequence_mean", paper="SAPO, arXiv:2511.20347", epilogue="sapo")
def sapo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Soft gate instead of a clip: −σ(τ(ρ − 1))·4/τ · A, τ = τ_pos if A > 0 else τ_neg."""
    tau = torch.where(terms.advantages > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
    return -torch.sigmoid(tau * (terms.ratio - 1)) * 4 / tau * terms.advantages


def vespo_weights(terms: TokenTerms, options: LossOptions) -> Tensor:
    """VESPO's gamma weight φ(w) = e^λ · w^k · e^(−λw) of the sequence IS ratio w, detached, [B, 1].

    w = Π_t ρ_t (times the rollout IS weights), in log space with TRL's clamps: per-token log-ratio to [−20, 20],
    log w and log is_ratio to [ln 1e-8, 20]; (k, λ) = (k_pos, λ_pos) when A ≥ 0 else (k_neg, λ_neg). Unlike TRL,
    which sums log is_ratio over padding too (where its own rollouts put 1), padding is masked out here.
    """
    floor = math.log(1e-8)
    with torch.no_grad():
        mask = terms.mask
        log_w = (terms.token_log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
        if terms.is_ratio is not None:
            log_is = terms.is_ratio.log().clamp(floor, 20.0)  # [B, T] or [B, 1]
            log_w = log_w + (log_is * mask if log_is.shape == mask.shape else log_is).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)  # [B, 1]
        nonneg = terms.advantages >= 0
        k = torch.where(nonneg, options.vespo_k_pos, options.vespo_k_neg)
        lam = torch.where(nonneg, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
        log_phi = lam + k * log_w - lam * log_w.exp()
        return log_phi.exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@policy_loss("vespo", normaliser="item_mean", paper="VESPO, arXiv:2602.10693", absorbs_is_ratio=True)
def vespo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """REINFORCE weighted by the detached gamma weight of the sequence ratio: −φ(w)·A·logp."""
    return -vespo_weights(terms, options) * terms.advantages * terms.logp

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

from grpo_kernels.losses.divergence import dppo_flags, dppo_kl, dppo_tv, dro
from grpo_kernels.losses.reduce import sequence_mean, sequence_sum
from grpo_kernels.losses.terms import LOG_RATIO_CLAMP, TokenTerms
from grpo_kernels.options import LossOptions

PolicyTerm = Callable[[TokenTerms, LossOptions], Tensor]
RatioFn = Callable[[TokenTerms, LossOptions], Tensor]
ClipFlags = Callable[[TokenTerms, LossOptions, Tensor], tuple[Tensor, Tensor]]


def token_ratio(terms: TokenTerms, options: LossOptions) -> Tensor:
    """The importance ratio at `importance_sampling_level`, [B, T] or [B, 1]."""
    return terms.ratio


def trust_region_flags(terms: TokenTerms, options: LossOptions, ratio: Tensor) -> tuple[Tensor, Tensor]:
    """(low, high): where the ratio (after any `delta` cap) leaves [1 − ε_low, 1 + ε_high] against A's sign."""
    ratio = ratio if options.delta is None else ratio.clamp(max=options.delta)
    low = (ratio < 1 - options.epsilon) & (terms.advantages < 0)
    high = (ratio > 1 + options.clip_high) & (terms.advantages > 0)
    return low, high


def no_clip_flags(terms: TokenTerms, options: LossOptions, ratio: Tensor) -> tuple[Tensor, Tensor]:
    """For terms that never clip: all False."""
    never = torch.zeros_like(terms.mask, dtype=torch.bool)
    return never, never


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss type: its per-token term, its normaliser (aggregate.NORMALISERS) and its source."""

    name: str
    term: PolicyTerm
    normaliser: str
    paper: str
    ratio: RatioFn = token_ratio  # the importance ratio the term uses (for the metrics)
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


def clipped_surrogate(
    terms: TokenTerms, options: LossOptions, ratio: Tensor | None = None, dual_clip: bool = True
) -> Tensor:
    """PPO clip −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A); `delta` caps the unclipped ρ (INTELLECT-2); with
    `clip_ratio_c`, tokens with A < 0 are capped at −A·c (dual-clip, arXiv:1912.09729, verl semantics)."""
    ratio = terms.ratio if ratio is None else ratio  # [B, T] or [B, 1]
    adv = terms.advantages
    clipped = ratio.clamp(1 - options.epsilon, 1 + options.clip_high)
    if options.delta is not None:
        ratio = ratio.clamp(max=options.delta)
    loss = -torch.min(ratio * adv, clipped * adv)
    if dual_clip and options.clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.min(loss, -adv * options.clip_ratio_c), loss)
    return loss


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


def _cispo_flags(terms: TokenTerms, options: LossOptions, ratio: Tensor) -> tuple[Tensor, Tensor]:
    if options.cispo_two_sided:  # the weight is clipped whatever the advantage's sign
        return ratio < 1 - options.epsilon, ratio > 1 + options.clip_high
    high = (ratio > options.clip_high) & (terms.advantages > 0)
    return torch.zeros_like(high), high


@policy_loss(
    "cispo", normaliser="item_mean", paper="MiniMax-M1, arXiv:2506.13585", clip_flags=_cispo_flags, epilogue="cispo"
)
def cispo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """REINFORCE with a capped, stop-gradient IS weight: −sg(w)·A·logp, w = min(ρ, ε_high) (TRL: ε_high is the
    cap) or, with `cispo_two_sided`, w = clip(ρ, 1 − ε_low, 1 + ε_high) (the paper's and verl's form)."""
    if options.cispo_two_sided:
        weight = terms.ratio.clamp(1 - options.epsilon, 1 + options.clip_high)  # [B, T] or [B, 1]
    else:
        weight = terms.ratio.clamp(max=options.clip_high)  # [B, T] or [B, 1]
    return -weight.detach() * terms.advantages * terms.logp


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
        per_token = terms.token_log_ratio.clamp(-20.0, 20.0)  # [B, T]
        log_is = None if terms.is_ratio is None else terms.is_ratio.log().clamp(floor, 20.0)  # [B, T] or [B, 1]
        if log_is is not None and log_is.shape == mask.shape:
            per_token = per_token + log_is
        log_w = sequence_sum(per_token, mask, terms.sequence_group)  # [B, 1]
        if log_is is not None and log_is.shape != mask.shape:  # one weight per sequence
            log_w = log_w + log_is.sum(-1, keepdim=True)
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


@policy_loss("gpg", normaliser="item_mean", paper="GPG, arXiv:2504.02546", clip_flags=no_clip_flags, epilogue="gpg")
def gpg(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Plain policy gradient −A·logp: no ratio, no clip (GPG eq. 5); its α = B/B_valid goes into A."""
    return -terms.advantages * terms.logp


def _masked_sequence_mean(x: Tensor, terms: TokenTerms) -> Tensor:
    return sequence_mean(x, terms.mask, terms.sequence_group)  # [B, 1]


def gspo_token_ratio(terms: TokenTerms, options: LossOptions) -> Tensor:
    """s_{i,t} = sg(s_i)·π/sg(π): the value of GSPO's sequence ratio with a per-token gradient, [B, T]."""
    log_s = _masked_sequence_mean(terms.token_log_ratio, terms).detach()  # [B, 1]
    log_s_t = log_s + terms.logp - terms.logp.detach()  # [B, T]
    return log_s_t.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


@policy_loss(
    "gspo_token", normaliser="sequence_mean", paper="GSPO-token, arXiv:2507.18071 eq. 13", ratio=gspo_token_ratio
)
def gspo_token(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped surrogate on GSPO-token's ratio sg(s_i)·π/sg(π), which admits per-token advantages."""
    return clipped_surrogate(terms, options, gspo_token_ratio(terms, options))


def trajectory_ratio(terms: TokenTerms, options: LossOptions) -> Tensor:
    """w_i = π_θ(o_i)/π_old(o_i) = exp(Σ_t (logp − old)), in log space and clamped to ±20, [B, 1]."""
    log_w = sequence_sum(terms.token_log_ratio, terms.mask, terms.sequence_group)  # [B, 1]
    return log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


@policy_loss("tic_grpo", normaliser="sequence_mean", paper="TIC-GRPO, arXiv:2508.02833", ratio=trajectory_ratio)
def tic_grpo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Clipped surrogate on the trajectory ratio w_i (not length-normalised, unlike GSPO). Clip widths are the
    usual ones; the paper's are unverified (spec §18)."""
    return clipped_surrogate(terms, options, trajectory_ratio(terms, options))


def _gmpo_log_ratios(terms: TokenTerms, options: LossOptions) -> tuple[Tensor, Tensor, Tensor]:
    """(lr, lr clipped to [−ε_low, ε_high] in log space, lr_min the sign(A)-pessimistic of the two), [B, T]."""
    lr = terms.token_log_ratio  # [B, T]
    sign = torch.sign(terms.advantages).expand_as(lr)  # [B, T]
    lr_clipped = lr.clamp(-options.epsilon, options.clip_high)  # [B, T]
    return lr, lr_clipped, sign * torch.min(sign * lr, sign * lr_clipped)


def gmpo_ratio(terms: TokenTerms, options: LossOptions) -> Tensor:
    """GMPO's geometric-mean ratio exp(mean_t lr_min), clamped to ±20 in log space, [B, 1]."""
    lr_min = _gmpo_log_ratios(terms, options)[2]  # [B, T]
    return _masked_sequence_mean(lr_min, terms).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _gmpo_flags(terms: TokenTerms, options: LossOptions, ratio: Tensor) -> tuple[Tensor, Tensor]:
    lr, lr_clipped, _ = _gmpo_log_ratios(terms, options)
    clipped = lr != lr_clipped  # [B, T]
    return clipped & (terms.advantages < 0), clipped & (terms.advantages > 0)


def geometric_mean_is_ratio(terms: TokenTerms) -> Tensor:
    """Each sequence's rollout IS weight for gmpo: exp(mean_t log(w_t + 1e-10)) over its kept tokens, [B, 1].

    verl `geo_mean`'s reduction of `rollout_is_weights`: GMPO's ratio is a geometric mean of token ratios, so the
    correction of each token's ratio by w_t enters as the geometric mean of the w_t. verl's 1e-10 is kept: a zero
    weight among n tokens gives a factor (1e-10)^(1/n), not 0. A per-sequence weight [B, 1] gives itself.
    """
    log_w = (terms.is_ratio + 1e-10).log().expand_as(terms.mask)  # [B, T]
    return _masked_sequence_mean(log_w, terms).exp()


@policy_loss(
    "gmpo",
    normaliser="sequence_mean",
    paper="GMPO, arXiv:2507.20673",
    ratio=gmpo_ratio,
    clip_flags=_gmpo_flags,
    absorbs_is_ratio=True,
)
def gmpo(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Geometric-mean policy optimisation: −Ā_i·exp(mean_t lr_min) per sequence, token log-ratios clipped in
    log space to [−ε_low, ε_high] on the side A's sign makes pessimistic (verl `geo_mean`), [B, 1]; times the
    geometric mean of `is_ratio` over the sequence (verl's `rollout_is_weights` reduction)."""
    advantage = _masked_sequence_mean(terms.advantages.expand_as(terms.mask), terms)  # [B, 1]
    loss = -advantage * gmpo_ratio(terms, options)  # [B, 1]
    return loss if terms.is_ratio is None else loss * geometric_mean_is_ratio(terms)


def _token_covariance(terms: TokenTerms) -> Tensor:
    """(A − Ā)·(logp − mean logp) of each kept token, means over all kept tokens of the batch, detached, [M].

    Clip-Cov and KL-Cov's per-token centred cross term (arXiv:2505.22617 eq. 11), in the kept tokens' row-major
    order (verl's). It couples every token of the batch: these losses run two-phase, never in a fused epilogue.
    """
    keep = terms.mask.bool()  # [B, T]
    adv = terms.advantages.detach().expand_as(terms.mask)[keep]  # [M]
    logp = terms.logp.detach()[keep]  # [M]
    return (adv - adv.mean()) * (logp - logp.mean())  # [M]


@torch.no_grad()
def clip_cov_candidates(terms: TokenTerms, options: LossOptions) -> tuple[Tensor, Tensor]:
    """(candidates [B, T] bool, n): kept tokens that PPO's clip leaves unclipped and whose covariance lies in
    (clip_cov_lb, clip_cov_ub), and how many of them clip_cov detaches, n = max(⌊clip_cov_ratio · M⌋, 1) (a 0-dim
    int64 tensor: no host sync). The covariance is `_token_covariance`'s, in the padded layout (verl's)."""
    keep = terms.mask.bool()  # [B, T]
    low, high = trust_region_flags(terms, options, terms.ratio)  # [B, T] or [B, 1]
    kept = terms.mask.sum().clamp(min=1.0)
    adv = torch.where(keep, terms.advantages.detach(), 0.0)  # [B, T], padding never read (it may hold NaN)
    logp = torch.where(keep, terms.logp.detach(), 0.0)  # [B, T]
    cov = (adv - adv.sum() / kept) * (logp - logp.sum() / kept)  # [B, T]
    count = (terms.mask.sum().double() * options.clip_cov_ratio).floor().clamp(min=1.0).long()  # int(ratio · M)
    unclipped = ~(low | high).expand_as(keep)  # [B, T]
    return keep & unclipped & (cov > options.clip_cov_lb) & (cov < options.clip_cov_ub), count


@torch.no_grad()
def clip_cov_keep(terms: TokenTerms, options: LossOptions) -> Tensor:
    """1.0, or 0.0 at the tokens whose policy gradient clip_cov detaches, [B, T].

    n of the candidates (`clip_cov_candidates`) are drawn uniformly without replacement, as verl does it: one
    `torch.randperm(K)` on the default (CPU) generator over the K candidates in row-major order, whenever K > 0.
    No `torch.Generator` is taken: after `torch.manual_seed(s)` the draw is verl's under the same seed, and it
    advances the global RNG as verl's does. Called once per loss evaluation (the metric uses counts only).
    The draw's size K is read on the host, with n: one host sync (a CPU draw of data-dependent size needs it).
    """
    candidates, count = clip_cov_candidates(terms, options)  # [B, T]
    flat = candidates.reshape(-1)  # [B·T]
    num, count = torch.stack([flat.sum(), count]).tolist()  # the one host sync
    keep = torch.ones_like(terms.mask)  # [B, T]
    if num > 0:
        index = torch.nonzero_static(flat, size=num).squeeze(-1)  # [K], row-major: no second sync
        drop = torch.randperm(num)[:count]
        if index.device.type == "cuda":  # an async copy: a pageable one would sync again
            drop = drop.pin_memory()
        keep.view(-1)[index[drop.to(index.device, non_blocking=True)]] = 0.0
    return keep


def clip_cov_fraction(terms: TokenTerms, options: LossOptions) -> Tensor:
    """verl's clip_cov `pg_clipfrac`: the fraction of kept tokens detached, min(n, K) / M (no draw needed, no host
    sync)."""
    candidates, count = clip_cov_candidates(terms, options)
    fraction = torch.minimum(count, candidates.sum()).double() / terms.mask.sum().double().clamp(min=1.0)
    return fraction.to(terms.mask.dtype)


@policy_loss("clip_cov", normaliser="item_mean", paper="Clip-Cov, arXiv:2505.22617 (verl clip_cov)")
def clip_cov(terms: TokenTerms, options: LossOptions) -> Tensor:
    """PPO's clipped surrogate with the gradient cut (loss 0) at n random unclipped tokens of high covariance
    between advantage and log-prob (`clip_cov_keep`): −min(ρA, clip(ρ)A)·keep, [B, T]. No dual clip (verl)."""
    return clipped_surrogate(terms, options, dual_clip=False) * clip_cov_keep(terms, options)


@torch.no_grad()
def kl_cov_selected(terms: TokenTerms, options: LossOptions) -> Tensor:
    """1.0 at the k = max(⌊kl_cov_ratio · M⌋, 1) kept tokens of largest covariance (`torch.topk`), else 0.0, [B, T]."""
    keep = terms.mask.bool()  # [B, T]
    selected = torch.zeros_like(terms.mask)  # [B, T]
    cov = _token_covariance(terms)  # [M]
    if cov.numel() > 0:
        top = torch.zeros_like(cov)  # [M]
        top[torch.topk(cov, max(int(cov.numel() * options.kl_cov_ratio), 1)).indices] = 1.0
        selected[keep] = top
    return selected


@policy_loss("kl_cov", normaliser="item_mean", paper="KL-Cov, arXiv:2505.22617 (verl kl_cov)", clip_flags=no_clip_flags)
def kl_cov(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Unclipped surrogate −ρA plus ppo_kl_coef·|logp − old_logp| at the tokens of largest covariance between
    advantage and log-prob (`kl_cov_selected`), [B, T]."""
    penalty = options.ppo_kl_coef * terms.token_log_ratio.abs() * kl_cov_selected(terms, options)  # [B, T]
    return -terms.advantages * terms.ratio + penalty


# DPPO and DRO (terms in divergence.py): verl's loss_mode dppo_tv / dppo_kl / dro, its default token-mean normaliser
_DPPO = "DPPO, arXiv:2602.04879 (verl {})"
policy_loss("dppo_tv", normaliser="item_mean", paper=_DPPO.format("dppo_tv"), clip_flags=dppo_flags)(dppo_tv)
policy_loss("dppo_kl", normaliser="item_mean", paper=_DPPO.format("dppo_kl"), clip_flags=dppo_flags)(dppo_kl)
policy_loss("dro", normaliser="item_mean", paper="DRO, arXiv:2405.19107 (verl dro)", clip_flags=no_clip_flags)(dro)

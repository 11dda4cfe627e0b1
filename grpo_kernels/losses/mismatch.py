"""The sampler-mismatch correction on `[B, T]` (`RolloutCorrection`): IS weights, rejection and their metrics in one
call, all tensors (no host read), detached.

verl 0.9.1's `rollout_corr_helper` is the specification of the IS weights, the rejection statistics and the metrics
(`tests/test_mismatch_verl.py` runs it on the same tensors); NeMo RL's geometric-mean mask and prime-rl's IPO mask
follow their sources (`reference_mismatch.py` transcribes them). Means are verl's `sum / (count + 1e-8)`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.losses.mismatch_metrics import (
    EPS,
    float32_mean,
    is_metrics,
    masked_mean,
    masked_sum,
    offpolicy_metrics,
    rule_metrics,
)
from grpo_kernels.rollout_correction import SAFETY_BOUND, RejectionRule, RolloutCorrection


class Correction(NamedTuple):
    """`weights` [B, T] (0 at padding; None: no weight), `keep` [B, T] bool (the tokens rejection keeps; None: no
    rejection) and the metrics, 0-dim tensors under `rollout_corr/` + verl's or NeMo's name."""

    weights: Tensor | None
    keep: Tensor | None
    metrics: dict[str, Tensor]


def apply_rollout_correction(
    correction: RolloutCorrection, old_logp: Tensor, sampling_logp: Tensor, mask: Tensor, policy_logp: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor, dict[str, Tensor]]:
    """(π_old, IS weight, kept mask, metrics) of a loss's inputs under `correction`, [B, T] each: decoupled, the
    weights are π_old's against the sampler; bypass, π_old is the sampler's and the weights are π_θ's (`policy_logp`,
    detached here) against it. The rejected tokens leave the mask."""
    policy = None if policy_logp is None else policy_logp.detach()
    if correction.bypass_mode:
        old_logp, trained = sampling_logp, policy
    else:
        trained = old_logp
    weights, keep, metrics = rollout_correction(trained, sampling_logp, mask, correction, policy)
    return old_logp, weights, mask if keep is None else mask & keep, metrics


@torch.no_grad()
def normaliser_mask(
    correction: RolloutCorrection | None, old_logp: Tensor | None, sampling_logp: Tensor | None, mask: Tensor
) -> Tensor:
    """The tokens [B, T] a token-count normaliser counts under `correction`, as verl counts them: a decoupled
    rejection is formed from π_old before the loss, so verl drops its rejected tokens from the response mask and from
    `batch_num_tokens`; under bypass (or with π_old unknown before the update pass, `old_logp` None) the rejection is
    formed inside the loss from π_θ, and the count is the mask's before it."""
    if correction is None or correction.bypass_mode or not correction.rules or old_logp is None:
        return mask
    keep, _ = rejection_keep(old_logp - sampling_logp, mask.bool(), correction.rules)
    return mask.bool() & keep


@torch.no_grad()
def rollout_correction(
    train_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    correction: RolloutCorrection,
    policy_logp: Tensor | None = None,
) -> Correction:
    """The correction of `train_logp` (π_old, or the policy itself under bypass) against the sampler's
    `sampling_logp`, [B, T] each, on the tokens of `mask` [B, T]; `policy_logp` [B, T]: π_θ for the IPO mask."""
    mask = mask.bool()  # [B, T]
    log_ratio = train_logp - sampling_logp  # [B, T]
    metrics: dict[str, Tensor] = {}
    if mask.shape[0] == 0:  # no sequence: nothing to weigh, no mean to take (but the batch mean's all-reduce)
        if correction.rollout_is_batch_normalize:
            batch_mean(log_ratio, mask, correction.rollout_is)
        return Correction(None, None, metrics)
    weights = None
    if correction.rollout_is is not None:
        weights, is_stats = importance_weights(log_ratio, mask, correction)
        metrics |= is_stats
    if correction.geo_bounds is not None:  # NeMo's seq-mask-tis: sequences kept by their geometric-mean ratio
        geo_keep = geometric_mean_keep(log_ratio, mask, *correction.geo_bounds)  # [B, 1]
        metrics["geo_mask_masked_fraction"] = 1.0 - masked_mean(geo_keep[:, 0].to(log_ratio.dtype), mask.any(-1))
        weights = _times(weights, geo_keep, mask, log_ratio.dtype)
    if correction.ipo_threshold is not None:  # prime-rl IPO: the policy term dropped where p moved more than ε
        if policy_logp is None:
            raise ValueError("ipo_threshold needs the policy's log-probs (policy_logp)")
        ipo_keep = (policy_logp.exp() - sampling_logp.exp()).abs() <= correction.ipo_threshold  # [B, T]
        metrics["ipo_masked_fraction"] = masked_mean((~ipo_keep).to(log_ratio.dtype), mask)
        weights = _times(weights, ipo_keep, mask, log_ratio.dtype)
    keep = None
    if correction.rules:
        keep, rs_stats = rejection_keep(log_ratio, mask, correction.rules)
        metrics |= rs_stats
    metrics |= offpolicy_metrics(train_logp, sampling_logp, mask)
    return Correction(weights, keep, {f"rollout_corr/{name}": value for name, value in metrics.items()})


def importance_weights(log_ratio: Tensor, mask: Tensor, correction: RolloutCorrection) -> tuple[Tensor, dict]:
    """The IS weights [B, T] (0 at padding) at `rollout_is` level, truncated or masked (IcePop) to their bounds and
    batch-normalised when asked, with verl's IS metrics."""
    bound = correction.log_ratio_bound
    if correction.rollout_is == "sequence":
        log_weight = masked_sum(log_ratio, mask, -1)[:, None]  # [B, 1]
    else:
        log_weight = log_ratio  # [B, T]
    clamped = log_weight if bound is None else log_weight.clamp(-bound, bound)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    raw = torch.where(mask, clamped.exp().expand(mask.shape), zero)  # [B, T]
    lower, upper = correction.rollout_is_threshold_lower, correction.rollout_is_threshold
    if correction.rollout_is_bounds == "mask":  # IcePop: 0 outside [lower, upper]
        inside = (raw >= (0.0 if lower is None else lower)) & (raw <= (math.inf if upper is None else upper))
        weights = torch.where(inside, raw, zero)  # [B, T]
    elif lower is None and upper is None:
        weights = raw
    else:  # TIS
        weights = raw.clamp(min=lower, max=upper)  # [B, T]
    metrics = is_metrics(weights, raw, log_weight, mask, correction)
    if correction.rollout_is_batch_normalize:
        mean = batch_mean(weights, mask, correction.rollout_is)
        usable = mean > EPS  # verl: no rescaling below 1e-8 (nor at NaN: no token on any rank)
        factor = torch.where(usable, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def batch_mean(weights: Tensor, mask: Tensor, level: str) -> Tensor:
    """verl's batch mean of the IS weights [B, T]: over the kept tokens ("token"), or over the sequences' own means
    ("sequence"). Under an initialised process group it is the mean over every rank's batch, as verl's
    `distributed_masked_mean` takes it: one all-reduce of the sum and the count (a tensor: no host read), so every
    rank of the default group makes the call, as data-parallel ranks do."""
    if level == "token":
        values, kept = weights, mask  # [B, T]
    else:
        values, kept = masked_mean(weights, mask, -1), mask.any(-1)  # [B]
    if not (dist.is_available() and dist.is_initialized()):
        if level == "token":
            return masked_mean(weights, mask)
        return masked_sum(values, kept) / kept.to(values.dtype).sum().clamp(min=EPS)
    totals = torch.stack([masked_sum(values, kept), kept.to(values.dtype).sum()])  # [2]
    dist.all_reduce(totals)
    return totals[0] / totals[1]


def geometric_mean_keep(log_ratio: Tensor, mask: Tensor, lower: float, upper: float) -> Tensor:
    """NeMo RL's seq-mask-tis: keep a sequence when exp(mean_t log r) lies in [lower, upper], non-finite log-ratios
    counting 0 (NeMo's nan_to_num); [B, 1] bool."""
    finite = torch.nan_to_num(log_ratio, nan=0.0, posinf=0.0, neginf=0.0)  # [B, T]
    geo = masked_mean(finite, mask, -1).exp()  # [B]
    return ((geo >= lower) & (geo <= upper))[:, None]


def rejection_keep(log_ratio: Tensor, mask: Tensor, rules: tuple[RejectionRule, ...]) -> tuple[Tensor, dict]:
    """verl's rejection: each rule's statistic of the clamped log-ratio (k1 = −log r, k2 = ½(log r)², k3 = r − 1 −
    log r; per token, or each sequence's sum, mean or max) against its bounds; a token stays when every rule keeps
    it. Returns keep [B, T] bool and verl's rejection metrics. A sequence rule stays [B, 1] until the rules combine."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
    per_token: dict[str, Tensor] = {}  # the estimators the rules use, [B, T] each
    dropped: Tensor | None = None  # rejected by some rule: [B, T], or [B, 1] while every rule is per sequence
    metrics: dict[str, Tensor] = {}
    for rule in rules:
        scope, estimator = rule.statistic.rsplit("_", 1)
        if estimator not in per_token:
            per_token[estimator] = _estimator(estimator, safe)
        stat = _statistic(per_token[estimator], mask, scope)  # [B, T] or [B, 1]
        if estimator == "k1":
            keep = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
        else:
            keep = stat <= rule.upper
        metrics |= rule_metrics(rule.statistic, stat, keep, mask)
        dropped = ~keep if dropped is None else dropped | ~keep
    dropped = dropped.expand(mask.shape)  # [B, T]
    dtype = log_ratio.dtype
    metrics["rollout_rs_masked_fraction"] = masked_mean(dropped.to(dtype), mask)
    metrics["rollout_rs_seq_masked_fraction"] = float32_mean((dropped & mask).any(-1), dtype)
    return ~dropped, metrics


def _estimator(name: str, safe: Tensor) -> Tensor:
    """verl's divergence estimator `name` of the clamped log-ratio, per token: k1 = −log r, k2 = ½(log r)²,
    k3 = r − 1 − log r."""
    if name == "k1":
        return -safe
    if name == "k2":
        return 0.5 * safe.square()
    return safe.exp() - 1.0 - safe


def _statistic(per_token: Tensor, mask: Tensor, scope: str) -> Tensor:
    """A rule's statistic: per token [B, T], or per sequence [B, 1] (sum, mean, or max over kept tokens, 0 when a
    sequence has none)."""
    if scope == "token":
        return per_token
    if scope == "seq_sum":
        return masked_sum(per_token, mask, -1)[:, None]
    if scope == "seq_mean":
        return masked_mean(per_token, mask, -1)[:, None]
    peak = per_token.masked_fill(~mask, -math.inf).amax(-1, keepdim=True)  # [B, 1]
    return torch.where(peak == -math.inf, torch.zeros_like(peak), peak)


def _times(weights: Tensor | None, keep: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """`weights` (None: 1 on the kept tokens, 0 at padding) times the bool `keep` [B, T] or [B, 1]."""
    factor = (keep & mask).to(dtype)  # [B, T]
    return factor if weights is None else weights * factor

"""compute_loss: per-token policy term -> entropy selection -> IS weight -> KL -> weights -> normaliser, plus the
entropy bonus and the metrics. TRL's order of operations; every step a few lines."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.divergence import dppo_keep
from grpo_kernels.losses.entropy import high_entropy_mask
from grpo_kernels.losses.kl import kl_penalty
from grpo_kernels.losses.policy import POLICY_LOSSES, clip_cov_fraction, clipped_surrogate, vespo_weights
from grpo_kernels.losses.reduce import all_reduce_sum, batch_sum, sequence_mean
from grpo_kernels.losses.terms import TokenTerms
from grpo_kernels.options import CLIPPED_SURROGATE_TYPES, DPPO_TYPES, LossOptions


class GRPOLossOutput(NamedTuple):
    """`loss`: 0-dim tensor to minimise; `metrics`: detached 0-dim tensors (TRL's metric names)."""

    loss: Tensor
    metrics: dict[str, Tensor]


def compute_loss(terms: TokenTerms, options: LossOptions) -> tuple[GRPOLossOutput, Tensor]:
    """The loss of `options.loss_type` on `terms`, and each sequence's share of it (before the entropy bonus), [B].

    The shares sum to the loss without `entropy_coef`; they are what DARO's and λ-GRPO's weights need.
    """
    group = terms.sequence_group
    if group is not None and options.loss_type in ("clip_cov", "kl_cov"):
        raise ValueError(f"loss_type={options.loss_type!r} couples every token of the batch: no sequence_group")
    kept = terms.mask  # [B, T], the tokens the policy term and the entropy bonus act on
    if options.top_entropy_quantile < 1.0:
        kept = high_entropy_mask(terms.entropy.detach(), terms.mask, options.top_entropy_quantile, group)  # [B, T]
    normaliser = POLICY_LOSSES[options.loss_type].normaliser
    kl = kl_penalty(terms, options) if options.beta != 0.0 else None  # [B, T]: the loss's term and its metric
    per_token = per_token_loss(terms, options, kept, kl) * token_weights_for(terms.mask, normaliser, options, group)
    sequence_losses = per_token.sum(-1)  # [B]
    loss = sequence_losses.sum()
    if options.entropy_coef != 0.0:  # TRL: L − coef·mean entropy of the kept tokens, whatever the normaliser
        bonus = batch_sum(terms.entropy * kept, group) / batch_sum(kept, group).clamp(min=1.0)
        loss = loss - options.entropy_coef * bonus
    return GRPOLossOutput(loss, loss_metrics(terms, options, kl)), sequence_losses


def per_token_loss(
    terms: TokenTerms, options: LossOptions, kept: Tensor | None = None, kl: Tensor | None = None
) -> Tensor:
    """Each token's loss before the normaliser: policy term (on the `kept` tokens when the entropy quantile
    selects) · IS weight + β·KL, times token/sequence weights; [B, T] or [B, 1]."""
    spec = POLICY_LOSSES[options.loss_type]
    per_token = spec.term(terms, options)  # [B, T] or [B, 1]
    if options.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_keep(terms, options)  # [B, 1]
    if options.top_entropy_quantile < 1.0:
        per_token = per_token * kept
    if terms.is_ratio is not None and not spec.absorbs_is_ratio:
        per_token = per_token * terms.is_ratio
    if options.beta != 0.0:
        per_token = per_token + options.beta * (kl_penalty(terms, options) if kl is None else kl)  # [B, T]
    correction = options.rollout_correction
    if correction is not None and correction.log_ratio_penalty != 0.0:  # prime-rl: τ·(log π_θ − log π_sampler)²
        per_token = per_token + correction.log_ratio_penalty * (terms.logp - terms.sampling_logp).square()  # [B, T]
    if terms.weights is not None:
        per_token = per_token * terms.weights  # [B, T]
    return per_token


@torch.no_grad()
def off_policy_keep(terms: TokenTerms, options: LossOptions) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, TRL's definition: keep a sequence (1.0) when A ≥ 0 or when the
    masked mean over its tokens of log π_sampler − log π_θ is at most `off_policy_mask_threshold`; [B, 1].

    The sampler's log-probs are `sampling_logp` (vLLM's), else `old_logp`; a NaN there (a token the sampler
    could not score) counts as 0, as in TRL. A per-token advantage counts by its sign at each token (TRL's rule).
    """
    sampler = terms.old_logp if terms.sampling_logp is None else terms.sampling_logp
    mean_kl = sequence_mean(torch.nan_to_num(sampler - terms.logp, nan=0.0), terms.mask, terms.sequence_group)  # [B, 1]
    return ((terms.advantages >= 0) | (mean_kl <= options.off_policy_mask_threshold)).to(terms.mask.dtype)


def _per_sequence_sums(named: dict[str, Tensor], mask: Tensor, group) -> Tensor:
    """Each named [B, T] (or broadcast [B, 1]) tensor, bool or float, summed over each sequence's kept tokens on
    every rank of `group`, and each sequence's kept-token count last: [k + 1, B]. One stacked reduction (`stack`
    promotes bool flags to the mask's float dtype), and with a group one all-reduce that every rank runs with the
    same k whatever its local T, so that none waits alone."""
    rows = [x if x.shape == mask.shape else x.expand(mask.shape) for x in named.values()]
    return all_reduce_sum((torch.stack([*rows, mask]) * mask).sum(-1), group)  # [k + 1, B]


def _masked_means(named: dict[str, Tensor], sums: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Each tensor's mean over the kept tokens (`sums` from `_per_sequence_sums`), or over all sequences for a
    per-sequence [B, 1] one (TRL's rule; at T = 1 TRL's shape test would also average padding, so there a [B, 1]
    tensor is taken per token)."""
    totals = sums.sum(-1)  # [k + 1]
    means = dict(zip(named, (totals / totals[-1].clamp(min=1.0)).unbind(), strict=False))  # the count's own last
    if mask.shape[-1] > 1:
        for name, x in named.items():
            if x.shape[-1] == 1:
                means[name] = x.to(mask.dtype).sum() / max(x.shape[0], 1)
    return means


def _sequence_extremes(
    low: Tensor, high: Tensor, flag_sums: Tensor, counts: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """The min over sequences of each sequence's fraction of `low` tokens, and the max of its fraction of `high`
    tokens (TRL's `low_min` / `high_max`); `flag_sums` [2, B]: each sequence's low and high counts, `counts` [B]:
    its kept tokens.

    A per-sequence [B, 1] flag is that sequence's value, as in TRL; sequences with no kept token have no fraction
    and are skipped (TRL's NaN, dropped by its nanmin / nanmax); 0 when no sequence has one. Both extremes in one
    reduction: the max of the high fractions is minus the min of their negatives.
    """
    if mask.shape[0] == 0:
        return mask.new_zeros(()), mask.new_zeros(())
    if low.shape[-1] == 1 and mask.shape[-1] > 1:
        signed = torch.stack([low[:, 0], high[:, 0]]).to(mask.dtype)  # [2, B]
    else:
        signed = flag_sums / counts  # [2, B]: 0 / 0 = NaN where a sequence has no kept token
    signed[1].neg_()  # min of the low fractions, -max of the high ones (a fresh tensor: no host-built constant)
    extremes = signed.nan_to_num(nan=math.inf).amin(-1).nan_to_num(posinf=0.0)  # [2]; skipped: +inf; all: 0
    low_min, minus_high_max = extremes.unbind()
    return low_min, -minus_high_max


@torch.no_grad()
def loss_metrics(terms: TokenTerms, options: LossOptions, kl: Tensor | None = None) -> dict[str, Tensor]:
    """TRL's logged quantities (clip fractions, kl, entropy) plus `ratio/mean`, detached 0-dim tensors; `kl`: the
    per-token KL penalty when the loss already computed it."""
    spec = POLICY_LOSSES[options.loss_type]
    ratio = spec.ratio(terms, options)
    low, high = spec.clip_flags(terms, options, ratio)
    averaged = {  # each averaged over the kept tokens (`_masked_means`)
        "clip_ratio/low_mean": low,
        "clip_ratio/high_mean": high,
        "clip_ratio/region_mean": low | high,
        "ratio/mean": ratio,
    }
    if options.clip_ratio_c is not None and options.loss_type in DPPO_TYPES:  # kept tokens whose weight is capped
        averaged["clip_ratio/truncated_mean"] = (ratio > options.clip_ratio_c) & dppo_keep(terms, options)
    elif options.clip_ratio_c is not None:  # where the dual clip's −A·c floor is the loss
        adv = terms.advantages
        unfloored = clipped_surrogate(terms, options, ratio, dual_clip=False)
        averaged["clip_ratio/dual_mean"] = (adv < 0) & (unfloored > -adv * options.clip_ratio_c)
    if options.beta != 0.0:
        averaged["kl"] = kl_penalty(terms, options) if kl is None else kl
    if terms.entropy is not None:
        averaged["entropy"] = terms.entropy
    if options.loss_type == "vespo":
        averaged["vespo/phi_seq_mean"] = vespo_weights(terms, options)
    if options.loss_type == "kl_cov":  # verl's name: kl_cov's mean |logp − old_logp|
        averaged["ppo_kl_abs"] = terms.token_log_ratio.abs()
    sums = _per_sequence_sums(averaged, terms.mask, terms.sequence_group)  # [k + 1, B]; low and high first
    metrics = _masked_means(averaged, sums, terms.mask)
    if options.loss_type in CLIPPED_SURROGATE_TYPES:  # TRL's per-sequence extremes of the clip fractions
        low_min, high_max = _sequence_extremes(low, high, sums[:2], sums[-1], terms.mask)
        metrics["clip_ratio/low_min"], metrics["clip_ratio/high_max"] = low_min, high_max
    if options.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = metrics["clip_ratio/region_mean"]
    if options.loss_type == "clip_cov":  # verl's name: the fraction detached
        metrics["pg_clipfrac"] = clip_cov_fraction(terms, options)
    if terms.correction_metrics is not None:
        metrics.update(terms.correction_metrics)
    return {name: value.detach() if value.requires_grad else value for name, value in metrics.items()}

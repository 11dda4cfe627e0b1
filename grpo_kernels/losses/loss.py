"""compute_loss: per-token policy term -> entropy selection -> IS weight -> KL -> weights -> normaliser, plus the
entropy bonus and the metrics. TRL's order of operations; every step a few lines."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.divergence import dppo_keep
from grpo_kernels.losses.entropy import high_entropy_mask
from grpo_kernels.losses.kl import kl_penalty
from grpo_kernels.losses.policy import POLICY_LOSSES, clip_cov_fraction, clipped_surrogate, vespo_weights
from grpo_kernels.losses.reduce import batch_sum, sequence_mean, sequence_sum, sequence_tokens
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
    per_token = per_token_loss(terms, options, kept) * token_weights_for(terms.mask, normaliser, options, group)
    sequence_losses = per_token.sum(-1)  # [B]
    loss = sequence_losses.sum()
    if options.entropy_coef != 0.0:  # TRL: L − coef·mean entropy of the kept tokens, whatever the normaliser
        bonus = batch_sum(terms.entropy * kept, group) / batch_sum(kept, group).clamp(min=1.0)
        loss = loss - options.entropy_coef * bonus
    return GRPOLossOutput(loss, loss_metrics(terms, options)), sequence_losses


def per_token_loss(terms: TokenTerms, options: LossOptions, kept: Tensor | None = None) -> Tensor:
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
        per_token = per_token + options.beta * kl_penalty(terms, options)  # [B, T]
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


def _masked_mean(x: Tensor, mask: Tensor, group, kept_count: Tensor) -> Tensor:
    """Mean over kept tokens (on every rank of `group`; `kept_count` their number, at least 1) of a [B, T] tensor,
    or over all sequences of a per-sequence [B, 1] one (TRL's rule; at T = 1 TRL's shape test would also average
    padding, so there a [B, 1] tensor is taken per token). With a group every rank runs the all-reduces whatever its
    local T, so that none waits alone."""
    token_mean = batch_sum(x * mask, group) / kept_count
    if x.shape[-1] == 1 and mask.shape[-1] > 1:
        return x.sum() / max(x.shape[0], 1)
    return token_mean


def _sequence_extremes(low: Tensor, high: Tensor, mask: Tensor, group=None) -> tuple[Tensor, Tensor]:
    """The min over sequences of each sequence's fraction of `low` tokens, and the max of its fraction of `high`
    tokens (TRL's `low_min` / `high_max`).

    A per-sequence [B, 1] flag is that sequence's value, as in TRL; sequences with no kept token have no fraction
    and are skipped (TRL's NaN, dropped by its nanmin / nanmax); 0 when no sequence has one. With a group, the
    fractions are over every rank's tokens (all-reduces every rank runs, as in `_masked_mean`).
    """
    counts = sequence_tokens(mask, group)[:, 0]  # [B]
    denominators, uncounted, counted = counts.clamp(min=1.0), counts == 0, (counts > 0).any()

    def extreme(flags: Tensor, reduce, skip: float) -> Tensor:  # skip: never the extreme while a sequence counts
        per_sequence = sequence_sum(flags.to(mask.dtype), mask, group)[:, 0] / denominators  # [B]
        if flags.shape[-1] == 1 and mask.shape[-1] > 1:
            per_sequence = flags[:, 0].to(mask.dtype)  # [B]
            return reduce(per_sequence) if per_sequence.numel() else mask.new_zeros(())
        value = reduce(per_sequence.masked_fill(uncounted, skip)) if per_sequence.numel() else mask.new_zeros(())
        return torch.where(counted, value, 0.0)  # no host sync (a boolean index would be one)

    return extreme(low, torch.min, float("inf")), extreme(high, torch.max, float("-inf"))


@torch.no_grad()
def loss_metrics(terms: TokenTerms, options: LossOptions) -> dict[str, Tensor]:
    """TRL's logged quantities (clip fractions, kl, entropy) plus `ratio/mean`, detached 0-dim tensors."""
    spec = POLICY_LOSSES[options.loss_type]
    ratio = spec.ratio(terms, options)
    low, high = spec.clip_flags(terms, options, ratio)
    group = terms.sequence_group
    kept_count = batch_sum(terms.mask, group).clamp(min=1.0)  # every mean's denominator
    mean = lambda x: _masked_mean(x.to(terms.mask.dtype), terms.mask, group, kept_count)  # noqa: E731
    metrics = {
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(low | high),
        "ratio/mean": mean(ratio),
    }
    if options.loss_type in CLIPPED_SURROGATE_TYPES:  # TRL's per-sequence extremes of the clip fractions
        metrics["clip_ratio/low_min"], metrics["clip_ratio/high_max"] = _sequence_extremes(low, high, terms.mask, group)
    if options.clip_ratio_c is not None and options.loss_type in DPPO_TYPES:  # kept tokens whose weight is capped
        metrics["clip_ratio/truncated_mean"] = mean((ratio > options.clip_ratio_c) & dppo_keep(terms, options))
    elif options.clip_ratio_c is not None:  # where the dual clip's −A·c floor is the loss
        adv = terms.advantages
        unfloored = clipped_surrogate(terms, options, ratio, dual_clip=False)
        metrics["clip_ratio/dual_mean"] = mean((adv < 0) & (unfloored > -adv * options.clip_ratio_c))
    if options.beta != 0.0:
        metrics["kl"] = mean(kl_penalty(terms, options))
    if terms.entropy is not None:
        metrics["entropy"] = mean(terms.entropy)
    if options.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = metrics["clip_ratio/region_mean"]
    if options.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = mean(vespo_weights(terms, options))
    if options.loss_type == "clip_cov":  # verl's names: the fraction detached, kl_cov's mean |logp − old_logp|
        metrics["pg_clipfrac"] = clip_cov_fraction(terms, options)
    if options.loss_type == "kl_cov":
        metrics["ppo_kl_abs"] = mean(terms.token_log_ratio.abs())
    return {name: value.detach() if value.requires_grad else value for name, value in metrics.items()}

"""TokenTerms: the per-token quantities every variant is written in, built once per loss call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.losses.reduce import sequence_mean
from grpo_kernels.options import LossOptions

LOG_RATIO_CLAMP = 20.0  # |log importance weight| cap: exp stays finite, as in verl


@dataclass(frozen=True)
class TokenTerms:
    """Per-token inputs of the loss algebra; `[B, 1]` entries are per-sequence values broadcast over T."""

    logp: Tensor  # [B, T] log π_θ(token), differentiable
    old_logp: Tensor  # [B, T] log π_old(token); logp.detach() when on-policy
    ref_logp: Tensor | None  # [B, T] log π_ref(token)
    advantages: Tensor  # [B, 1] or [B, T]
    mask: Tensor  # [B, T] float, 1 = token counts
    entropy: Tensor | None  # [B, T] full-vocabulary entropy, when computed (differentiable: the entropy bonus)
    is_ratio: Tensor | None  # [B, 1] or [B, T] rollout importance weight (vLLM IS correction)
    weights: Tensor | None  # [B, T] token_weights × sequence_weights, multiplying each token's whole loss
    log_ratio: Tensor  # [B, T] (token level) or [B, 1] (sequence level): log importance weight, in ±LOG_RATIO_CLAMP
    ratio: Tensor  # exp(log_ratio), same shape
    sampling_logp: Tensor | None = None  # [B, T] the sampler's log-probs (off-policy mask); old_logp when None
    sequence_group: Any = None  # the ranks each sequence's tokens are split over (`losses.reduce`); None: here
    correction_metrics: dict[str, Tensor] | None = None  # the sampler-mismatch correction's (`losses.mismatch`)

    @property
    def token_log_ratio(self) -> Tensor:
        """logp − old_logp per token, [B, T], whatever the importance-sampling level."""
        return self.logp - self.old_logp


def build_terms(
    logp: Tensor,
    *,
    advantages: Tensor,
    mask: Tensor,
    options: LossOptions,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    is_ratio: Tensor | None = None,
    token_weights: Tensor | None = None,
    sequence_weights: Tensor | None = None,
    sampling_logp: Tensor | None = None,
    sequence_group: Any = None,
    correction_metrics: dict[str, Tensor] | None = None,
) -> TokenTerms:
    """Promote shapes ([B] -> [B, 1]) and dtypes (to logp's), and form the importance ratio at its level.

    Padding never reaches the loss, not even as inf or NaN: where the mask is 0, old and ref log-probs are
    taken equal to logp (log-ratio 0, KL 0), per-token advantages and weights to 0 and IS weights to 1.
    The log importance weight is clamped to ±LOG_RATIO_CLAMP (as verl does) so that exp never overflows: this
    acts only where the ratio would pass e^20 ≈ 4.9e8 or fall under e^-20, and its gradient is 0 there.
    """
    dtype = logp.dtype
    keep = mask.bool()  # [B, T]
    mask = mask.to(dtype)  # [B, T]

    def at_padding(x: Tensor, fill) -> Tensor:  # per-token x gets `fill` where the mask is 0
        return torch.where(keep, x.to(dtype), fill) if x.shape == keep.shape else x.to(dtype)

    detached = logp.detach()
    old_logp = detached if old_logp is None else at_padding(old_logp, detached)  # [B, T]
    ref_logp = None if ref_logp is None else at_padding(ref_logp, detached)  # [B, T]
    sampling_logp = None if sampling_logp is None else at_padding(sampling_logp, detached)  # [B, T]
    advantages = at_padding(per_sequence_or_token(advantages), 0.0)  # [B, 1] or [B, T]
    is_ratio = None if is_ratio is None else at_padding(per_sequence_or_token(is_ratio), 1.0)  # [B, 1] or [B, T]
    weights = None
    if token_weights is not None or sequence_weights is not None:
        weights = torch.ones_like(mask) if token_weights is None else at_padding(token_weights, 0.0)  # [B, T]
        weights = weights if sequence_weights is None else weights * sequence_weights.to(dtype)[:, None]  # [B, T]
    token_log_ratio = logp - old_logp  # [B, T]
    if options.importance_sampling_level == "sequence":  # GSPO: masked mean of the log-ratio per sequence
        log_ratio = sequence_mean(token_log_ratio, mask, sequence_group)  # [B, 1]
    else:
        log_ratio = token_log_ratio  # [B, T]
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return TokenTerms(
        logp=logp,
        old_logp=old_logp,
        ref_logp=ref_logp,
        advantages=advantages,
        mask=mask,
        entropy=entropy,
        is_ratio=is_ratio,
        weights=weights,
        log_ratio=log_ratio,
        ratio=log_ratio.exp(),
        sampling_logp=sampling_logp,
        sequence_group=sequence_group,
        correction_metrics=correction_metrics,
    )


def per_sequence_or_token(x: Tensor | None) -> Tensor | None:
    """[B] -> [B, 1] (one value per sequence, broadcast over T); [B, T] and None pass through."""
    return x.unsqueeze(-1) if x is not None and x.dim() == 1 else x

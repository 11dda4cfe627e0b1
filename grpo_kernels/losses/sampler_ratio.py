"""The sampler correction of TRL's `vllm_importance_sampling_*` options: π_old / π_sampler per token or per
sequence, truncated or masked, multiplying the policy term (`is_ratio`). The trainer forms it from its π_old pass;
`fused_linear_grpo_loss(sampler_correction=...)` forms it inside the loss, also from the pass's own log-probs
(old_logp None: π_old is π_θ at the update)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from grpo_kernels.shown import shown

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """π_old / π_sampler, TRL's `vllm_importance_sampling_*` correction: [B, T] for token modes, [B] for sequence
    modes (the product over the sequence's tokens). `*_truncate` clamps to [clip_min, clip_max]; `*_mask` sets
    ratios outside it to 0. It multiplies the policy term (`is_ratio`): the sampler (vLLM) and the trainer compute
    slightly different distributions, and the update must be for samples of π_old."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {shown(mode)}")
    log_diff = (old_logp - sampling_logp) * mask  # [B, T]
    if mode.startswith("sequence"):
        log_diff = log_diff.sum(dim=1)  # [B]
    ratio = torch.exp(log_diff)  # [B, T] or [B]
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@dataclasses.dataclass(frozen=True)
class SamplerCorrection:
    """TRL's `vllm_importance_sampling_*` correction: `ratio` is π_old / π_sampler, [B, T] or [B]."""

    mode: str
    clip_min: float | None
    clip_max: float | None

    def __post_init__(self) -> None:
        if self.mode not in IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {shown(self.mode)}")

    @property
    def per_sequence(self) -> bool:
        """Whether the ratio is the product over each sequence's tokens (it needs the whole sequence's π_old)."""
        return self.mode.startswith("sequence")

    def ratio(self, old_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> Tensor:
        return importance_sampling_ratio(old_logp, sampling_logp, mask, self.mode, self.clip_min, self.clip_max)

"""The sampler correction of TRL's `vllm_importance_sampling_*` options: π_old / π_sampler per token or per
sequence, truncated or masked, multiplying the policy term (`is_ratio`)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from grpo_kernels.shown import shown
from grpo_kernels.trainer.rollout import RolloutBatch

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
    """TrainConfig's `vllm_importance_sampling_*` correction: `ratio` is π_old / π_sampler, [B, T] or [B]."""

    mode: str
    clip_min: float | None
    clip_max: float | None

    def ratio(self, old_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> Tensor:
        return importance_sampling_ratio(old_logp, sampling_logp, mask, self.mode, self.clip_min, self.clip_max)


def correction_of(config) -> SamplerCorrection | None:
    """The correction TrainConfig `config` asks for, or None when it is off."""
    if not config.vllm_importance_sampling_correction:
        return None
    return SamplerCorrection(
        config.vllm_importance_sampling_mode,
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    )


def sampler_correction(old_logp: Tensor, batch: RolloutBatch, config) -> Tensor | None:
    """The `is_ratio` of TrainConfig's `vllm_importance_sampling_*` options, or None when the correction is off.
    With `HFRollout` it is 1 up to float error (the sampler is the policy itself): a live consistency check."""
    correction = correction_of(config)
    if correction is None:
        return None
    return correction.ratio(old_logp, batch.sampling_logp, batch.completion_mask)  # [B, T] or [B]

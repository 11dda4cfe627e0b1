"""The trainer's sampler correction (TrainConfig's `vllm_importance_sampling_*` options); the ratio itself is
`losses.sampler_ratio`'s."""

from __future__ import annotations

from torch import Tensor

from grpo_kernels.losses.sampler_ratio import IS_MODES, SamplerCorrection, importance_sampling_ratio
from grpo_kernels.trainer.rollout import RolloutBatch

__all__ = ["IS_MODES", "SamplerCorrection", "correction_of", "importance_sampling_ratio", "sampler_correction"]


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

"""The records of one training step's samples and weights, shared by the preset components (`components.py`) and the
learned weights (`preset_weights.py`); built by keyword only (several of their fields are float [B] tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from grpo_kernels.trainer.rollout import RolloutBatch


@dataclass(frozen=True, kw_only=True)
class StepSamples:
    """The rollouts a step trains on, after the sampler, with their rewards (`rewards` and `advantages` stay apart)."""

    batch: RolloutBatch
    group_ids: Tensor  # [B] long, dense, CPU
    rewards: Tensor  # [B] the step reward (the preset's pipeline), CPU
    terms: Tensor  # [B, K] the pipeline's entries, unweighted (GDPO's reward matrix)
    correct: Tensor  # [B] bool: the task's `answer` column > 0.5
    sequence_weights: Tensor | None  # [B] the sampler's (GPG's α)
    metrics: dict[str, float]
    inputs: dict[str, Tensor] = field(default_factory=dict)  # [B] each: produced advantage inputs (PVPO's V̂)


@dataclass(frozen=True, kw_only=True)
class StepWeights:
    """The regularizers' weights for `UpdateBatch`; `learned` is `sequence` attached to learned parameters."""

    token: Tensor | None  # [B, T]
    sequence: Tensor | None  # [B]; a leaf that collects dL/dw when `learned` is set
    learned: Tensor | None  # [B]
    context: Any = None  # what the learner keeps of the step (DARO's bins and token counts)

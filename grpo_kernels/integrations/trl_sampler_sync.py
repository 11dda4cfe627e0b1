"""The TRL drop-in's sampler-sync guard (`GRPOConfig.sampler_sync`, off by default: TRL's behaviour): each training
micro-batch compares TRL's old log-probs with the sampler's (vLLM's, or a `rollout_func`'s) over the kept tokens of
every process, before the loss and its backward, so before the optimizer step; a mean gap over the limit stops
(`StaleSampler`, the trainer's message and limits: `grpo_kernels/trainer/sampler_sync.py`) or warns. The trainer's
trend rule reads the mean gaps of the earlier optimizer steps (`StepGaps`): a gap that rose at each of the last
steps stops the run below the limit too."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from grpo_kernels.trainer.dropout import dropout_settings
from grpo_kernels.trainer.sampler_sync import (
    LOGP_DIFFERENCE,
    TREND_RISES,
    StaleSampler,
    check_sampler_sync,
    logp_tolerance,
)


@dataclass
class StepGaps:
    """The guard's mean gaps per optimizer step, for the trend rule: the finished steps' (the latest `TREND_RISES`)
    and the running sums of the step in progress. Kept in memory, not in TRL's checkpoints: a resumed run starts the
    trend afresh."""

    step: int = -1
    total: float = 0.0  # the gaps' sum over the step's micro-batches so far, every process
    count: float = 0.0  # their kept tokens
    finished: list[float] = field(default_factory=list)

    def earlier(self, step: int) -> list[float]:
        """The mean gaps of the steps before `step` (finishing the one in progress when `step` is a new one)."""
        if step != self.step:
            if self.count:
                self.finished = [*self.finished, self.total / self.count][-TREND_RISES:]
            self.step, self.total, self.count = step, 0.0, 0.0
        return self.finished

    def add(self, total: float, count: float) -> None:
        self.total, self.count = self.total + total, self.count + count


def check_trl_sampler_sync(trainer, model: nn.Module, inputs: dict) -> None:
    """The guard on one micro-batch of `trainer` (a drop-in `GRPOTrainer`, `model` its model as `compute_loss` gets
    it) in training mode; nothing when `sampler_sync` is "off" or the inputs lack either log-probs (no vLLM, no
    rollout_func log-probs)."""
    action = getattr(trainer.args, "sampler_sync", "off")
    old, sampled = inputs.get("old_per_token_logps"), inputs.get("sampling_per_token_logps")
    if action == "off" or old is None or sampled is None or not trainer.model.training:
        return
    delta = (old - sampled).abs()  # [B, T]
    kept = inputs["completion_mask"].bool() & ~torch.isnan(delta)  # NaN: a token the sampler could not score
    gaps = delta.masked_fill(~kept, 0.0)
    local = torch.stack([gaps.sum(), kept.sum().to(gaps.dtype), gaps.max() if gaps.numel() else gaps.new_zeros(())])
    every = trainer.accelerator.gather(local[None].float())  # [processes, 3]: the same numbers on every process
    total, count = float(every[:, 0].sum()), float(every[:, 1].sum())
    metrics = {
        f"{LOGP_DIFFERENCE}/mean": total / max(count, 1.0),
        f"{LOGP_DIFFERENCE}/max": float(every[:, 2].max()),
    }
    model = trainer.accelerator.unwrap_model(model)
    dtype = next(model.parameters()).dtype
    tolerance = getattr(trainer.args, "sampler_sync_tolerance", None) or logp_tolerance(dtype, dtype)
    step = trainer.state.global_step + 1
    gaps = trainer._sampler_sync_gaps  # set when the drop-in is installed
    earlier = gaps.earlier(step)
    gaps.add(total, count)
    try:
        check_sampler_sync(metrics, tolerance, step, dropout_settings(model), earlier)
    except StaleSampler as error:
        if action == "stop":
            raise
        warnings.warn(str(error), stacklevel=2)

"""The TRL drop-in's sampler-sync guard (`GRPOConfig.sampler_sync`, off by default: TRL's behaviour): each training
micro-batch compares TRL's old log-probs with the sampler's (vLLM's, or a `rollout_func`'s) over the kept tokens of
every process, before the loss and its backward, so before the optimizer step; a mean gap over the limit stops
(`StaleSampler`, the trainer's message and limits: `grpo_kernels/trainer/sampler_sync.py`) or warns. The trainer's
trend rule reads the mean gaps of the earlier optimizer steps (`StepGaps`, kept across a resume): a gap that rose at
each of the last steps stops the run below the limit too."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from grpo_kernels.shown import shown
from grpo_kernels.trainer.dropout import dropout_settings
from grpo_kernels.trainer.sampler_sync import (
    LOGP_DIFFERENCE,
    TREND_RISES,
    StaleSampler,
    check_sampler_sync,
    logp_tolerance,
    valid_gaps,
)


class StepGaps(TrainerCallback, ExportableState):
    """The guard's mean gaps per optimizer step, for the trend rule: the finished steps' (the latest `TREND_RISES`)
    and the running sums of the step in progress. A checkpoint keeps the latest steps' means in its trainer state (an
    `ExportableState` callback, under `stateful_callbacks` of `trainer_state.json`), and a resumed run reads them back
    at the start of training, so its trend rule goes on where it was, as the trainer's does."""

    def __init__(self) -> None:
        self.step = -1
        self.total = 0.0  # the gaps' sum over the step's micro-batches so far, every process
        self.count = 0.0  # their kept tokens
        self.finished: list[float] = []

    def earlier(self, step: int) -> list[float]:
        """The mean gaps of the steps before `step` (finishing the one in progress when `step` is a new one)."""
        if step != self.step:
            self.finished = self.latest()
            self.step, self.total, self.count = step, 0.0, 0.0
        return self.finished

    def add(self, total: float, count: float) -> None:
        self.total, self.count = self.total + total, self.count + count

    def latest(self) -> list[float]:
        """The mean gaps of the latest `TREND_RISES` steps, the one in progress included when it has any."""
        if not self.count:
            return self.finished
        return [*self.finished, self.total / self.count][-TREND_RISES:]

    def state(self) -> dict:
        return {"args": {}, "attributes": {"finished": self.latest()}}

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        """Take the gaps a resumed checkpoint kept (none in a fresh run, or in a checkpoint written before they were
        kept); gaps that are not numbers >= 0 are a ValueError naming the trainer state."""
        name = type(self).__name__
        stored = state.stateful_callbacks.setdefault(name, self.state())  # transformers saves into an existing entry
        attributes = stored.get("attributes") if isinstance(stored, dict) else None
        gaps = attributes.get("finished") if isinstance(attributes, dict) else None
        if not valid_gaps(gaps):
            raise ValueError(f"trainer_state.json: stateful_callbacks.{name}.attributes.finished must be gaps >= 0, "
                             f"got {shown(gaps)}")  # fmt: skip
        self.step, self.total, self.count, self.finished = -1, 0.0, 0.0, gaps[-TREND_RISES:]


def step_gaps(trainer) -> StepGaps:
    """The drop-in's `StepGaps` among `trainer`'s callbacks (transformers replaces it with a copy when it restores
    callback states)."""
    return next(callback for callback in trainer.callback_handler.callbacks if isinstance(callback, StepGaps))


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
    gaps = step_gaps(trainer)
    earlier = gaps.earlier(step)
    gaps.add(total, count)
    try:
        check_sampler_sync(metrics, tolerance, step, dropout_settings(model), earlier)
    except StaleSampler as error:
        if action == "stop":
            raise
        warnings.warn(str(error), stacklevel=2)

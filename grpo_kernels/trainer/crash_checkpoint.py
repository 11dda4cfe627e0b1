"""A checkpoint when a step fails with an exception, as one is written when a signal stops the run: the steps
trained since the last checkpoint are kept (with `--checkpoint-every 0` they would all be lost otherwise).

What is written is a state the run really passed through, never a step half done:
- the exception came before the step's first optimizer step: the previous step's end, with the prompt stream,
  the preset's components and the RNG as they were at the step's start (`begin` keeps them);
- it came after the step's training returned (in the evaluation, the metrics, a periodic checkpoint): that step;
- it came between the two (some of the step's updates taken): nothing, and a line says why.
A policy holding a non-finite weight is never written. One process only: under torchrun another rank may never
reach the collective writes of a checkpoint.
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from grpo_kernels.trainer import checkpoint
from grpo_kernels.trainer.parallel import ParallelState


class Trainer(Protocol):
    """What a crash checkpoint reads and restores of the trainer (`GRPOTrainer`)."""

    step: int
    saved_step: int | None
    saved_path: Path | None
    config: Any  # TrainConfig
    parallel: ParallelState
    prompts: Any  # PromptStream: state_dict, load_state_dict
    components: Any  # PresetComponents: state_dict, load_state_dict

    def save_checkpoint(self) -> None: ...


@dataclass(frozen=True)
class StepStart:
    """What a step's start held that the step changes before its first update: the prompt stream's position, the
    components' state, the RNG states, and how many optimizer steps the run had taken."""

    step: int  # the steps completed before it
    data: dict
    components: dict
    rng: dict
    optimizer_steps: int


class CrashCheckpoint:
    """Counts the optimizer's steps (a post-step hook) and keeps each step's `StepStart`; `save` writes the
    checkpoint an exception leaves, where there is a whole step to write."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_steps = 0
        optimizer.register_step_post_hook(self._count)
        self.start: StepStart | None = None
        self.trained = False  # whether the current step's training returned (its weights are that step's)

    def _count(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1

    def begin(self, trainer: Trainer) -> None:
        """Before step `trainer.step + 1`: keep what it will change."""
        self.start = StepStart(
            step=trainer.step,
            data=copy.deepcopy(trainer.prompts.state_dict()),
            components=copy.deepcopy(trainer.components.state_dict()),
            rng=checkpoint.rng_state(),
            optimizer_steps=self.optimizer_steps,
        )
        self.trained = False

    def save(self, trainer: Trainer, error: Exception) -> None:
        """After `error` in step `trainer.step`: write the checkpoint of the last whole step not yet written, and
        print where it is (or why there is none). A failure to write it is printed; `error` is what the run raises."""
        if self.start is None or trainer.parallel.world_size > 1 or not trainer.config.final_checkpoint:
            return
        if isinstance(error, checkpoint.CheckpointWriteError):  # a checkpoint write failed: another would too
            return
        failed = trainer.step
        step = failed if self.trained else self.start.step
        if not self.trained and self.optimizer_steps != self.start.optimizer_steps:
            print(
                f"no checkpoint of step {trainer.step} after the failure: it came after some of that step's updates "
                f"and before its end (latest checkpoint: {trainer.saved_path or 'none'})",
                flush=True,
            )
            return
        if step == trainer.saved_step or step == 0:
            return
        if not self.trained:  # back to the step's start: the state that went with these weights
            trainer.prompts.load_state_dict(self.start.data)
            trainer.components.load_state_dict(self.start.components)
            checkpoint.set_rng_state(self.start.rng)
            trainer.step = step
        try:
            trainer.save_checkpoint()
        except Exception as failure:  # noqa: BLE001 — the run's own error is the one to raise
            # a non-finite weight included (`checkpoint.NonFiniteWeights`): such a checkpoint is never written
            print(f"no checkpoint of step {step} after the failure: {failure}", flush=True)
            return
        steps = f"step {step} of {trainer.config.steps}"
        print(
            f"{type(error).__name__} in step {failed}: checkpoint {trainer.saved_path} holds {steps}; "
            f"continue: {resume_command(trainer.config.output_dir)}",
            flush=True,
        )


def resume_command(output_dir) -> str:
    """The command that continues the run in `output_dir`."""
    return f"python -m grpo_kernels.train --output-dir {shlex.quote(str(output_dir))} --resume"

"""Run directories: one run per `output_dir`, never mixed with another run's files.

- A new run (`resume=False`) needs `output_dir` absent or empty; `overwrite=True` clears it first.
- `resume=True` continues the run in `output_dir`: the configuration must agree with the run's `config.yaml` (and
  with the checkpoint's own copy) on every option outside `RESUMABLE`, else a ValueError names each option
  that differs. Training restarts from the latest complete checkpoint that reads back whole; an unreadable one
  (truncated, corrupt, a file missing, or more than tensors and plain data in a `.pt` file) is skipped with a warning
  naming the file. No checkpoint at all is an error, or a fresh start with `start_if_no_checkpoint=True`.
- `output_dir` naming a file is an error.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from grpo_kernels.shown import shown
from grpo_kernels.trainer import checkpoint
from grpo_kernels.trainer.config import TrainConfig, from_dict, yaml_mapping
from grpo_kernels.trainer.parallel import ParallelState

CONFIG_FILE = "config.yaml"  # <output_dir>/config.yaml: the run's configuration, what --resume continues with
# the options a resumed run may change (where it stops, how it logs, how long dynamic sampling tries); any other
# difference is an error
RESUMABLE = (
    "output_dir",
    "resume",
    "overwrite",
    "start_if_no_checkpoint",
    "steps",
    "max_num_gen_batches",
    "skip_nonfinite_steps",
    "checkpoint_every",
    "eval_every",
    "torch_threads",
    "report_to",
    "progress",
    "progress_every",
    "progress_seconds",
    "plot",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "sources",  # labels only: the values they describe are compared themselves
)


class CheckpointWarning(UserWarning):
    """A checkpoint skipped on resume because one of its files cannot be read."""


@dataclass(frozen=True)
class Start:
    """Where a resumed run continues: the checkpoint and what `checkpoint.read` got from it."""

    path: Path
    state: dict  # step, optimizer, data, components, config, rng

    @property
    def step(self) -> int:
        return int(self.state["step"])


def save_config(output_dir: str | Path, config_dict: dict) -> Path:
    """`<output_dir>/config.yaml`: the run's full configuration, what `--resume` continues with (and a valid
    `--config`)."""
    path = Path(output_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_dict, sort_keys=False), encoding="utf-8")
    return path


def load_run_config(output_dir: str | Path) -> TrainConfig | None:
    """The configuration saved in `<output_dir>/config.yaml` (what `--resume` continues with), or None."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return from_dict(yaml_mapping(path), where=str(path))


def config_differences(saved: TrainConfig, config: TrainConfig) -> list[str]:
    """`"name: saved -> given"` for each option outside `RESUMABLE` where `config` differs from the run's `saved`
    configuration (loss options by their own names), compared as `config.yaml` stores them."""

    def flat(c: TrainConfig) -> dict[str, Any]:
        data = yaml.safe_load(yaml.safe_dump(c.to_dict()))  # as config.yaml holds it
        return {**{k: v for k, v in data.items() if k != "loss"}, **data["loss"]}

    before, after = flat(saved), flat(config)
    return [
        f"{name}: {shown(before.get(name))} -> {shown(after.get(name))}"
        for name in [*after, *(k for k in before if k not in after)]
        if name not in RESUMABLE and before.get(name) != after.get(name)
    ]


def prepare(config: TrainConfig, parallel: ParallelState, *, ref_model: bool) -> Start | None:
    """Check (and, for `overwrite`, clear) `config.output_dir` before any work; the checkpoint a resumed run
    continues from, or None for a run from step 0. `ref_model`: whether the run keeps a reference model (β ≠ 0)."""
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {str(out)!r} is a file: --output-dir needs a directory (new or empty)")
    if not config.resume:
        if _entries(out) and not config.overwrite:
            raise ValueError(
                f"output_dir {str(out)!r} is not empty ({_describe(out)}): a new run does not write into another "
                "run's files; --resume continues the run there, --overwrite replaces it, or choose another --output-dir"
            )
        if config.overwrite and parallel.is_main and out.is_dir():
            _clear(out)
        _barrier(parallel)
        return None
    saved = load_run_config(out)
    if saved is None and _entries(out):
        raise ValueError(
            f"--resume: {str(out)!r} holds no {CONFIG_FILE}, so it holds no run this trainer can continue "
            f"({_describe(out)}); choose the run's directory with --output-dir"
        )
    if saved is not None:
        _check_same_run(saved, config, f"--resume: the run in {str(out)!r} ({CONFIG_FILE})")
    candidates = checkpoint.complete(out)
    for path in candidates:
        state = _read_on_every_rank(path, config, parallel, ref_model)
        if state is None:
            continue
        if "config" in state:
            _check_same_run(from_dict(state["config"], where=str(path)), config, f"--resume: checkpoint {path}")
        if state["step"] > config.steps:
            raise ValueError(
                f"steps ({config.steps}) is below the step of the checkpoint to resume from ({path}, step "
                f"{state['step']}): give --steps >= {state['step']}"
            )
        return Start(path, state)
    if candidates:
        raise ValueError(
            f"--resume: none of the {len(candidates)} checkpoint(s) in {str(out / checkpoint.CHECKPOINTS)!r} can be "
            "read (see the warnings); --overwrite starts the run again from step 0"
        )
    if not config.start_if_no_checkpoint:
        raise ValueError(
            f"--resume: no checkpoint in {str(out)!r} to resume from; drop --resume to start a new run, or add "
            "--start-if-no-checkpoint to start from step 0 when there is none"
        )
    return None


def _check_same_run(saved: TrainConfig, config: TrainConfig, where: str) -> None:
    differences = config_differences(saved, config)
    if differences:
        raise ValueError(
            f"{where} was made with other options: {'; '.join(differences)}. A resumed run keeps its configuration "
            f"(only {', '.join(RESUMABLE)} may change): drop these options, or start a new run in another "
            "--output-dir"
        )


def _read_on_every_rank(path: Path, config: TrainConfig, parallel: ParallelState, ref_model: bool) -> dict | None:
    """`checkpoint.read` on this rank; None (with a warning naming the file) when it, or another rank's, fails."""
    try:
        state = checkpoint.read(path, parallel.rank, lora=config.lora, ref_model=ref_model)
    except checkpoint.UnreadableCheckpoint as error:
        state = None
        rank = f"rank {parallel.rank}: " if parallel.world_size > 1 else ""
        warnings.warn(
            f"{rank}skipping checkpoint {path}: {error}; resuming from an earlier one",
            CheckpointWarning,
            stacklevel=3,
        )
    if parallel.world_size > 1:  # every rank resumes from the same checkpoint
        ok = torch.tensor([0 if state is None else 1], device=parallel.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        state = state if ok.item() else None
    return state


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.is_dir() else []


def _describe(directory: Path) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in _entries(directory)]
    return f"{len(names)} entries: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"


def _clear(directory: Path) -> None:
    for entry in _entries(directory):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _barrier(parallel: ParallelState) -> None:
    if parallel.world_size > 1:
        dist.barrier()

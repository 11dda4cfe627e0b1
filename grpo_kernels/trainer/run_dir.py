"""Run directories: one run per `output_dir`, never mixed with another run's files.

- One process writes a run directory: `prepare` claims its lock (`run_lock.py`) before anything else.
- A new run (`resume=False`) needs `output_dir` absent or empty; `overwrite=True` clears it first, but only a
  directory that holds a run (config.yaml and metrics.jsonl), never through a symlink.
- `resume=True` continues the run in `output_dir`: the configuration must agree with the run's `config.yaml` (and
  with the checkpoint's own copy) on every option outside `RESUMABLE`, else a ValueError names each option
  that differs. Training restarts from the latest complete checkpoint; one that does not read back whole
  (truncated, a checksum that differs, a file missing, more than tensors and plain data in a `.pt` file) is refused
  in a ValueError naming the file and offering the previous good checkpoint, never taken silently. No checkpoint at
  all is an error, or a fresh start with `start_if_no_checkpoint=True`.
- `output_dir` naming a file is an error.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from grpo_kernels.shown import shown
from grpo_kernels.trainer import atomic_write, checkpoint, run_lock
from grpo_kernels.trainer.config.files import from_dict
from grpo_kernels.trainer.config.record import TrainConfig
from grpo_kernels.trainer.config.resume import CONFIG_FILE, load_run_config
from grpo_kernels.trainer.logging import METRICS_FILE
from grpo_kernels.trainer.parallel import ParallelState

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
    "final_checkpoint",
    "eval_every",
    "torch_threads",
    "report_to",
    "vllm_show_log",
    "progress",
    "progress_every",
    "progress_seconds",
    "plot",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "sources",  # labels only: the values they describe are compared themselves
)


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
    atomic_write.write_text(path, yaml.safe_dump(config_dict, sort_keys=False))  # never truncated in place
    return path


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
    """Claim `config.output_dir` for this run (its lock, `run_lock.py`), check it (and, for `overwrite`, clear it)
    before any work; the checkpoint a resumed run continues from, or None for a run from step 0. `ref_model`:
    whether the run keeps a reference model (β ≠ 0). The lock is held until `run_lock.release` or the process ends."""
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {str(out)!r} is a file: --output-dir needs a directory (new or empty)")
    _claim_on_main(out, parallel)
    try:
        return _prepare_claimed(out, config, parallel, ref_model)
    except BaseException:
        if parallel.is_main:
            run_lock.release(out)
        raise


def _prepare_claimed(out: Path, config: TrainConfig, parallel: ParallelState, ref_model: bool) -> Start | None:
    if not config.resume:
        if _entries(out) and not config.overwrite:
            advice = "--overwrite replaces it, " if holds_run(out) else ""
            raise ValueError(
                f"output_dir {str(out)!r} is not empty ({_describe(out)}): a new run does not write into another "
                f"run's files; --resume continues the run there, {advice}or choose another --output-dir"
            )
        if config.overwrite and _entries(out):
            check_replaceable(out)
            if parallel.is_main:
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
    if not candidates:
        if not config.start_if_no_checkpoint:
            raise ValueError(
                f"--resume: no checkpoint in {str(out)!r} to resume from; drop --resume to start a new run, or add "
                "--start-if-no-checkpoint to start from step 0 when there is none"
            )
        return None
    path = candidates[0]
    state, problem = _read_on_every_rank(path, config, parallel, ref_model)
    if state is None:
        raise ValueError(
            f"--resume: checkpoint {path} is refused: {problem}; "
            f"{_offer(path, candidates[1:], config, parallel, ref_model)}"
        )
    if "config" in state:
        _check_same_run(from_dict(state["config"], where=str(path)), config, f"--resume: checkpoint {path}")
    if state["step"] > config.steps:
        raise ValueError(
            f"steps ({config.steps}) is below the step of the checkpoint to resume from ({path}, step "
            f"{state['step']}): give --steps >= {state['step']}"
        )
    return Start(path, state)


def holds_run(directory: Path) -> bool:
    """Whether `directory` holds a trainer run (its config.yaml and metrics.jsonl)."""
    return (directory / CONFIG_FILE).is_file() and (directory / METRICS_FILE).is_file()


def check_replaceable(directory: Path) -> None:
    """`--overwrite` replaces a run, nothing else: a ValueError for a symlink or a directory that holds no run."""
    if directory.is_symlink():
        raise ValueError(
            f"--overwrite: output_dir {str(directory)!r} is a symlink; --overwrite never clears what a link points "
            "to: give the directory itself"
        )
    if not holds_run(directory):
        raise ValueError(
            f"--overwrite: output_dir {str(directory)!r} holds no run ({CONFIG_FILE} and {METRICS_FILE}), so it is "
            f"not cleared ({_describe(directory)}): choose another --output-dir"
        )


def _offer(refused: Path, older: list[Path], config: TrainConfig, parallel: ParallelState, ref_model: bool) -> str:
    """What the refusal of a corrupt checkpoint offers: the newest of `older` that reads back whole (never taken
    silently), or a fresh start."""
    for path in older:
        state, _ = _read_on_every_rank(path, config, parallel, ref_model)
        if state is not None:
            newer = f"{refused}" if path.name == older[0].name else f"{refused} and the ones after {path.name}"
            return (
                f"the previous good checkpoint is {path} (step {state['step']}): to continue from it, move {newer} "
                f"aside (e.g. `mv {refused} {refused}.corrupt`) and --resume again"
            )
    return "no earlier checkpoint reads back whole; --overwrite starts the run again from step 0"


def _claim_on_main(out: Path, parallel: ParallelState) -> None:
    """Rank 0 claims the run directory's lock for the whole run; every rank raises when it could not."""
    error = None
    if parallel.is_main:
        try:
            run_lock.claim(out)
        except run_lock.RunInUse as refused:
            error = refused
    if parallel.world_size > 1:
        ok = torch.tensor([0 if error is not None else 1], device=parallel.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and error is None:
            error = run_lock.RunInUse(f"{str(out)!r} is in use by another process (see rank 0's error)")
    if error is not None:
        raise error


def _check_same_run(saved: TrainConfig, config: TrainConfig, where: str) -> None:
    differences = config_differences(saved, config)
    if differences:
        raise ValueError(
            f"{where} was made with other options: {'; '.join(differences)}. A resumed run keeps its configuration "
            f"(only {', '.join(RESUMABLE)} may change): drop these options, or start a new run in another "
            "--output-dir"
        )


def _read_on_every_rank(
    path: Path, config: TrainConfig, parallel: ParallelState, ref_model: bool
) -> tuple[dict | None, str]:
    """`checkpoint.read` on this rank: (its state, "") or, when it or another rank's read fails, (None, the
    problem naming the file)."""
    try:
        state, problem = checkpoint.read(path, parallel.rank, lora=config.lora, ref_model=ref_model), ""
    except checkpoint.UnreadableCheckpoint as error:
        rank = f"rank {parallel.rank}: " if parallel.world_size > 1 else ""
        state, problem = None, f"{rank}{error}"
    if parallel.world_size > 1:  # every rank resumes from the same checkpoint
        ok = torch.tensor([0 if state is None else 1], device=parallel.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and state is not None:
            state, problem = None, "another rank cannot read it (see its error)"
    return state, problem


def _entries(directory: Path) -> list[Path]:
    """What `directory` holds, its lock file aside."""
    return sorted(p for p in directory.iterdir() if p.name != run_lock.LOCK_FILE) if directory.is_dir() else []


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

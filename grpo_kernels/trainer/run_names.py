"""Run directory names when `--output-dir` is not given: every run gets a new `runs/<name>-<timestamp>`, so a second
run never collides with the first; `--resume` needs the directory named, and its error names the latest run."""

from __future__ import annotations

import atexit
import dataclasses
import os
import time
from pathlib import Path

RUNS = "runs"  # the folder (in the working directory) that holds the runs named here
CONFIG_FILE = "config.yaml"  # what marks a run directory (config.resume.CONFIG_FILE)
_NAMED: list[Path] = []  # the run directories `new_run_dir` created in this process
MAX_STEPS_VARIABLE = "GRPO_KERNELS_MAX_STEPS"  # caps every run's --steps (quick checks of documented commands)


def new_run_dir(name: str, root: str | Path = RUNS) -> str:
    """A new, empty `<root>/<name>-<YYYYmmdd-HHMMSS>` (UTC), with `-2`, `-3`, ... when that exists already, claimed by
    creating it (two runs started in the same second get two directories). Under torchrun the ranks could name
    different directories, so there it is a ValueError asking for `--output-dir`."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("under torchrun give --output-dir: every rank must write into the same run directory")
    base = Path(root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    path, number = base, 1
    while True:
        try:
            path.mkdir()
        except FileNotFoundError:  # no `root` yet (or another process just removed its empty one)
            base.parent.mkdir(parents=True, exist_ok=True)
            continue
        except FileExistsError:
            number += 1
            path = base.with_name(f"{base.name}-{number}")
            continue
        if not _NAMED:
            atexit.register(release_unused)
        _NAMED.append(path)
        return str(path)


def release_unused() -> None:
    """Remove the run directories this process named and left empty, and their `runs/` where that leaves it empty:
    a command that fails before its run starts (a bad option, a missing model) leaves nothing behind. A run that
    started holds its lock file there, so it is never removed. Called on a user error and at exit."""
    while _NAMED:
        path = _NAMED.pop()
        for folder in (path, path.parent):
            try:
                folder.rmdir()  # only an empty directory
            except OSError:
                break


def latest_run_dir(root: str | Path = RUNS) -> Path | None:
    """The most recently changed directory under `root` holding a run (its config.yaml), or None."""
    runs = [p for p in Path(root).glob(f"*/{CONFIG_FILE}")] if Path(root).is_dir() else []
    return max(runs, key=lambda p: p.stat().st_mtime).parent if runs else None


def resume_needs_output_dir() -> ValueError:
    """The error of `--resume` without `--output-dir`, naming the latest run as a hint."""
    latest = latest_run_dir()
    hint = f" (the latest run here: --output-dir {latest})" if latest is not None else f" (no run under {RUNS}/ yet)"
    return ValueError(f"--resume needs --output-dir, the directory of the run to continue{hint}")


def run_label(preset: str | None, dataset: str, preset_given: bool) -> str:
    """A run's name: the preset given (a YAML file: its stem), else `demo` on the addition task, else the dataset."""
    if preset_given and preset is not None:
        return Path(preset).stem if preset.endswith((".yaml", ".yml")) else preset
    if dataset == "addition":
        return "demo"
    return Path(dataset).stem if dataset.endswith(".jsonl") else dataset


def with_output_dir(config, preset_given: bool = False):
    """`config` (a TrainConfig) with a new run directory when its `output_dir` is None, else as it is."""
    if config.output_dir is not None:
        return config
    label = run_label(config.preset, config.dataset, preset_given)
    return dataclasses.replace(config, output_dir=new_run_dir(label))


def capped_steps(config):
    """`config` (a TrainConfig) with `steps` at most `$GRPO_KERNELS_MAX_STEPS` when that is set (with a line saying
    so), else as it is."""
    cap = os.environ.get(MAX_STEPS_VARIABLE)
    if not cap or config.steps <= int(cap):
        return config
    print(f"{MAX_STEPS_VARIABLE}={cap}: steps {config.steps} capped at {cap}", flush=True)
    return dataclasses.replace(config, steps=int(cap))

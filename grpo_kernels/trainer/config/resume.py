"""What `--resume` continues with: the run's own configuration, `<output_dir>/config.yaml`. The trainer refuses a
resumed run whose options differ from it outside `run_dir.RESUMABLE` (`run_dir.py`)."""

from __future__ import annotations

from pathlib import Path

from grpo_kernels.trainer import run_names
from grpo_kernels.trainer.config.files import from_dict, yaml_mapping
from grpo_kernels.trainer.config.record import TrainConfig

CONFIG_FILE = "config.yaml"  # <output_dir>/config.yaml: the run's configuration, what --resume continues with


def load_run_config(output_dir: str | Path) -> TrainConfig | None:
    """The configuration saved in `<output_dir>/config.yaml` (what `--resume` continues with), or None."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return from_dict(yaml_mapping(path), where=str(path))


def resume_base(output_dir: str | None) -> TrainConfig:
    """The configuration `--resume` starts from, in place of the defaults: the run's `config.yaml` (the defaults when
    the directory holds none yet); a ValueError naming the latest run when no `--output-dir` is given."""
    if output_dir is None:
        raise run_names.resume_needs_output_dir()
    return load_run_config(output_dir) or TrainConfig()

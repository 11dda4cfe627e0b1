"""The trainer's configuration: `TrainConfig` and how it is made, one concern a module.

- `record.py`: `TrainConfig`, every trainer option once with its default (the defaults run the CPU demo);
- `algorithm.py`: a paper preset applied (`apply_preset`), the loss options and advantage estimator the trainer runs;
- `checks.py`: `check_config`, each option in its range and among its choices;
- `files.py`: a config from plain data (`from_dict`) and YAML files (`yaml_mapping`);
- `resume.py`: what `--resume` continues with, the run's own `config.yaml`;
- `parser.py`: the command line generated from the fields (`build_parser`);
- `command_line.py`: `parse_args`, the precedence of defaults, preset, YAML file and flags.

This file re-exports their public names and runs nothing; the modules import each other, never this file.
"""

from grpo_kernels.trainer.config.algorithm import advantage_function, apply_preset, loss_options
from grpo_kernels.trainer.config.checks import check_config, choices
from grpo_kernels.trainer.config.command_line import parse_args
from grpo_kernels.trainer.config.files import from_dict, yaml_mapping
from grpo_kernels.trainer.config.parser import DESCRIPTION, EPILOG, build_parser, field_docs
from grpo_kernels.trainer.config.record import (
    DEFAULT_PRESET,
    DEMO_MAX_LENGTH,
    NOT_CLI,
    PER_STEP_LOSS_OPTIONS,
    ROLLOUTS,
    TRAINING_SETTINGS,
    TrainConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "DEMO_MAX_LENGTH",
    "DESCRIPTION",
    "EPILOG",
    "NOT_CLI",
    "PER_STEP_LOSS_OPTIONS",
    "ROLLOUTS",
    "TRAINING_SETTINGS",
    "TrainConfig",
    "advantage_function",
    "apply_preset",
    "build_parser",
    "check_config",
    "choices",
    "field_docs",
    "from_dict",
    "loss_options",
    "parse_args",
    "yaml_mapping",
]

"""`parse_args`: a TrainConfig from the command line. Precedence, lowest first: the defaults (with `--resume`: the
run's own `config.yaml`, `resume.py`), a paper preset (`--preset dapo`, `algorithm.apply_preset`), a YAML file
(`--config file.yaml`, `files.py`), then the flags (`parser.py`). `check_config` refuses values out of range, naming
the option."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from grpo_kernels.options import LossOptions
from grpo_kernels.trainer import run_names
from grpo_kernels.trainer.config.algorithm import apply_preset
from grpo_kernels.trainer.config.checks import check_config
from grpo_kernels.trainer.config.files import from_dict, read_config_file
from grpo_kernels.trainer.config.parser import build_parser
from grpo_kernels.trainer.config.record import TRAINING_SETTINGS, TrainConfig
from grpo_kernels.trainer.config.resume import resume_base


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line: defaults < --preset < --config YAML < flags, checked (`check_config`).
    With `--resume`, the run's `config.yaml` in the output directory replaces the defaults, so the run continues
    with its own configuration; the trainer then refuses any difference outside `run_dir.RESUMABLE`."""
    args = vars(build_parser().parse_args(argv))
    args.pop("debug", None)
    config_file = args.pop("config_file", None)
    data = read_config_file(config_file)
    config = TrainConfig()
    if args.get("resume", data.get("resume", False)):
        config = resume_base(args.get("output_dir", data.get("output_dir")))
    preset_given = "preset" in args or "preset" in data
    paper_settings = args.get("paper_settings", data.get("paper_settings", False))
    if preset_given or paper_settings:
        config = apply_preset(config, args.get("preset", data.get("preset", config.preset)), paper_settings)
    in_yaml = {k: v for k, v in data.items() if k not in ("preset", "paper_settings")}
    config = from_dict(in_yaml, config, where=str(config_file))
    loss_names = {f.name for f in dataclasses.fields(LossOptions)} - {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {k: v for k, v in args.items() if k not in loss_names and k not in ("preset", "paper_settings")}
    loss_flags = {k: v for k, v in args.items() if k in loss_names}
    config = from_dict({**flags, "loss": loss_flags or None}, config, where="command line")
    in_file = {*data, *(["temperature"] if "temperature" in (data.get("loss") or {}) else [])}
    given = {n: "config file" for n in TRAINING_SETTINGS if n in in_file}
    given.update({n: "flag" for n in TRAINING_SETTINGS if n in args})
    config = dataclasses.replace(config, sources={**config.sources, **given})
    check_config(config)
    return run_names.with_output_dir(run_names.capped_steps(config), preset_given)

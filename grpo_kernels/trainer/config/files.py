"""A TrainConfig from plain data and YAML files: `--config file.yaml` (TrainConfig fields as keys, loss options under
`loss:`), a run's `config.yaml`, a checkpoint's copy of its config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_kernels.options import LossOptions, check_epsilon_names, some_names
from grpo_kernels.shown import shown
from grpo_kernels.trainer.config.record import TrainConfig
from grpo_kernels.yaml_files import read_yaml


def from_dict(data: Mapping[str, Any], base: TrainConfig | None = None, where: str = "config") -> TrainConfig:
    """`base` (default: the defaults) with the given fields replaced; `loss` is a mapping of loss options."""
    config = base or TrainConfig()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(map(str, set(data) - fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {some_names(unknown)}; valid keys are {sorted(fields)}")
    values = {k: v for k, v in data.items() if k != "loss"}
    if "sources" in values and not isinstance(values["sources"], Mapping):
        raise TypeError(f"{where}: sources must be a mapping of training settings, got {shown(values['sources'])}")
    loss = config.loss
    if data.get("loss") is not None:
        if not isinstance(data["loss"], Mapping):
            raise TypeError(f"{where}: loss must be a mapping of loss options, got {shown(data['loss'])}")
        given = dict(data["loss"])
        check_epsilon_names(given)
        loss_fields = {f.name: getattr(loss, f.name) for f in dataclasses.fields(LossOptions)}
        if given.get("epsilon_low") is not None and "epsilon" not in given:  # the alias given replaces epsilon
            loss_fields.pop("epsilon")
        try:
            loss = LossOptions.from_kwargs(**{**loss_fields, **given})
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}: loss: {error}") from None
    return dataclasses.replace(config, **values, loss=loss)


def yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping in YAML file `path` (empty: {}); a ValueError naming the file otherwise."""
    data = read_yaml(path) or {}
    if not isinstance(data, Mapping):
        raise TypeError(f"{path}: must be a mapping of TrainConfig fields, got {type(data).__name__}")
    return dict(data)


def read_config_file(config_file: str | None) -> dict[str, Any]:
    """The mapping in `--config`'s file ({} without one); a FileNotFoundError naming a file that is not there."""
    if config_file is None:
        return {}
    if not Path(config_file).is_file():
        raise FileNotFoundError(f"--config {config_file}: no such file")
    return yaml_mapping(Path(config_file))

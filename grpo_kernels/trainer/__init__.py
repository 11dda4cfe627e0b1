"""A lightweight GRPO trainer on the fused kernels: `train(TrainConfig(...))`, or `python -m grpo_kernels.train`.

The names below are imported on first use, so that `python -m grpo_kernels.train --help` does not load
transformers."""

import sys
from importlib import import_module
from types import ModuleType

_HOMES = {
    "GRPOTrainer": "grpo_kernels.trainer.train",
    "HFRollout": "grpo_kernels.trainer.rollout",
    "Rollout": "grpo_kernels.trainer.rollout",
    "RolloutBatch": "grpo_kernels.trainer.rollout",
    "TrainConfig": "grpo_kernels.trainer.config",
    "parse_args": "grpo_kernels.trainer.config",
    "train": "grpo_kernels.trainer.train",
}

__all__ = ["GRPOTrainer", "HFRollout", "Rollout", "RolloutBatch", "TrainConfig", "parse_args", "train"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


class _Package(ModuleType):
    """Keeps `train` the function: importing the submodule `trainer/train.py` would bind the module to that name."""

    def __setattr__(self, name: str, value) -> None:
        if not (name == "train" and isinstance(value, ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

"""A run's training settings (G, lr, temperature, μ, generation budget) and where each value came from.

`apply_preset` puts a paper preset's settings into the config and flags override them (`config/`); the trainer then
calls `resolve_settings`, which fixes the generation budget and completes `TrainConfig.sources`, the record in
`config.yaml` of where each effective value came from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_kernels import presets
from grpo_kernels.trainer.config.record import TRAINING_SETTINGS, TrainConfig

EXPLICIT_SOURCES = ("flag", "config file")  # what `parse_args` records in `sources`; the trainer derives the rest


def setting(config: TrainConfig, name: str) -> Any:
    """The value of training setting `name` (one of TRAINING_SETTINGS) in `config`."""
    return config.loss.temperature if name == "temperature" else getattr(config, name)


def resolve_settings(config: TrainConfig, task_budget: int) -> TrainConfig:
    """The config the trainer runs: the generation budget resolved (a flag's; else, with `paper_settings`, the
    preset's capped at the task's `task_budget`; else the task's) and `sources` naming where each training setting
    came from: what `parse_args` recorded (flag, config file), else `preset` where the value is the preset's,
    `default <value>` where it is TrainConfig's (with "the paper gives none" when the preset says "not given"), `set`
    otherwise (a TrainConfig built in Python). A resumed run's budget is already resolved: its recorded source stays."""
    with_paper = config.preset is not None and config.paper_settings  # else the preset's algorithm alone
    paper = presets.load(config.preset).training if with_paper else None
    budget, budget_source = config.max_completion_length, None
    if budget is None:
        cap = None if paper is None else paper.max_completion_length
        budget = task_budget if cap is None else min(cap, task_budget)
        budget_source = "preset" if cap is not None and cap <= task_budget else f"task budget ({task_budget} tokens)"
        if cap is not None and cap > task_budget:
            budget_source += f", below the paper's {cap}"
    config = dataclasses.replace(config, max_completion_length=budget)
    defaults, sources = TrainConfig(), {}
    for name in TRAINING_SETTINGS:
        value, given = setting(config, name), None if paper is None else getattr(paper, name)
        recorded = config.sources.get(name)
        if recorded in EXPLICIT_SOURCES or (name == "max_completion_length" and budget_source is None and recorded):
            sources[name] = recorded  # a flag, or the budget a resumed run resolved before
        elif name == "max_completion_length" and budget_source is not None:
            sources[name] = budget_source
        elif given is not None and value == given:
            sources[name] = "preset"
        elif value == setting(defaults, name):
            unstated = paper is not None and given is None
            sources[name] = f"default {value}" + (" (the paper gives none)" if unstated else "")
        else:
            sources[name] = "set"
    return dataclasses.replace(config, sources=sources)

"""The algorithm a config runs: a paper preset applied to it, the loss options and the advantage estimator the trainer
takes from it.

A paper preset (`--preset dapo`) brings its loss options, advantage estimator and training settings (G, lr,
temperature, μ); its rewards, with `math_answer` standing for the task's reward, its sampler and its regularizers are
built by the trainer (`components.py`). The generation budget is the paper's capped at the task's (a paper's 20,480
tokens on a task whose answers take 3 would be all padding); a flag sets it outright.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from grpo_kernels import presets
from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.options import LossOptions
from grpo_kernels.shown import shown
from grpo_kernels.trainer.config.record import TrainConfig


def loss_options(config: TrainConfig) -> LossOptions:
    """The loss options the trainer uses: `config.loss`, with Dr.GRPO's constant the run's generation budget when it
    is unset or is the preset paper's own budget (the recipe's constant is its generation budget: 3,000 tokens of a
    recipe are 3 on a 3-token task, as DAPO's L_max scales in `presets.rewards_for_budget`)."""
    constant = config.loss.max_completion_length
    paper = presets.load(config.preset).training.max_completion_length if config.preset is not None else None
    if constant is not None and constant != paper:
        return config.loss
    return dataclasses.replace(config.loss, max_completion_length=config.max_completion_length)


def advantage_function(config: TrainConfig) -> Callable[..., Any]:
    """The ADVANTAGES estimator `config.advantage`, called as fn(rewards, group_ids, **inputs, **advantage_kwargs).

    The trainer passes the per-step inputs the estimator names (`components.ADVANTAGE_INPUTS`: correctness, lengths,
    mean_logp, entropy, mask; GDPO's reward matrix; PVPO's `reference_value` from its pre-rollouts). One that needs
    another (Stratified-GRPO's `strata`) and does not get it from `advantage_kwargs` is a ValueError here, before any
    work.
    """
    from grpo_kernels.trainer.components import ADVANTAGE_INPUTS, missing_advantage_inputs

    fn = ADVANTAGES.get(config.advantage)
    missing = missing_advantage_inputs(fn, config.advantage_kwargs)
    if missing:
        preset = f" (preset {shown(config.preset)})" if config.preset is not None else ""
        raise ValueError(
            f"advantage {shown(config.advantage)}{preset} needs per-step inputs {missing} that the trainer cannot "
            f"produce (it supplies rewards, group_ids and {list(ADVANTAGE_INPUTS)})"
        )
    return fn


def apply_preset(config: TrainConfig, name: str | None, paper_settings: bool = True) -> TrainConfig:
    """The config with a paper preset's loss options, advantage estimator and training settings (G, lr, temperature,
    μ; TrainConfig's defaults where the paper gives none), and `preset` naming it: the trainer builds the preset's
    rewards, sampler and regularizers from that name (`components.PresetComponents`) and caps the generation budget
    at the paper's (`settings.resolve_settings`); `paper_settings=False` (the command line without
    `--paper-settings`) keeps `config`'s settings and budget. `None`: LossOptions' defaults, the `grpo` advantage
    with its defaults, TrainConfig's default settings and the task's reward alone."""
    defaults = TrainConfig()
    if name is None:
        settings = {n: getattr(defaults, n) for n in ("num_generations", "learning_rate", "num_iterations")}
        return dataclasses.replace(
            config, preset=None, loss=LossOptions(), advantage="grpo", advantage_kwargs={}, sources={}, **settings
        )
    preset = presets.load(name)
    training = preset.training
    settings = {
        n: getattr(defaults, n) if getattr(training, n) is None else getattr(training, n)
        for n in ("num_generations", "learning_rate", "num_iterations")
    }
    temperature = preset.loss.temperature if training.temperature is None else training.temperature
    if not paper_settings:
        settings = {n: getattr(config, n) for n in settings}
        temperature = config.loss.temperature
    return dataclasses.replace(
        config,
        preset=name,
        paper_settings=paper_settings,
        loss=dataclasses.replace(preset.loss, temperature=temperature),
        advantage=preset.advantage.name,
        advantage_kwargs=dict(preset.advantage.kwargs),
        sources={},
        **settings,
    )

"""Paper presets: one YAML file per paper in `grpo_kernels/configs/papers/`, loaded into a validated `Preset`.

A preset is data, never a code path: it names registered components and the paper's hyperparameters, and the
trainer builds them. `load("dapo")` reads `configs/papers/dapo.yaml` (or any YAML file given as a path),
`from_dict` takes a mapping, `available()` lists the shipped names. Nothing is read at import.

Top-level keys (any other key is a ValueError listing these):

- `name` (str): the variant's name as its paper writes it, e.g. `DAPO`.
- `paper`: `title` (str), and `arxiv` (a quoted string, e.g. `"2503.14476"`) or, where there is none, `openreview`
  (the forum id).
- `loss`: `LossOptions` fields only, with the paper's values; `loss_type` is required.
- `advantage`: `{name: <ADVANTAGES name>, <hyperparameter>: <value>, ...}`.
- `rewards`: a non-empty list of `{name: <REWARDS name>, weight: <float, default 1.0>, <hyperparameter>: ...}`, the
  reward pipeline in order: r_i = Σ_k weight_k · term_k. A reward that reads `rewards` (`dra_diversity`,
  `unlikeliness`, `rank_grpo`) reshapes the sum of the entries before it and replaces it by weight · f(sum), so it
  cannot come first. When the advantage takes the reward matrix [B, K] (`gdpo`), each entry is one column and its
  weight is w_k. `math_answer` stands for the task's verifier (swap in `gsm8k`, `countdown`, ...); the correctness
  inputs of other components (`correct`, `correctness`) are that verifier's verdict.
- `sampling` (optional): `{name: <SAMPLERS name>, ...}`.
- `regularizers` (optional): a list of `{name: <REGULARIZERS name>, ...}`.
- `training` (optional; every shipped preset has it): the paper's training settings, each a value or `"not given"`
  (absent: not given): `num_generations` (G), `learning_rate`, `temperature` (sampling, and the loss's),
  `num_iterations` (μ, updates per rollout batch: PPO epochs) and `max_completion_length` (the paper's generation
  budget in tokens). The trainer applies them (`trainer.config.apply_preset`); flags win; for "not given" it names
  the default it uses. Token lengths of rewards (DAPO's L_max, L_cache) are the paper's, relative to its budget:
  `rewards_for_budget` scales them to a run's budget.
- `notes` (optional): a list of strings: the constants and forms the spec labels unverified or partial, and caveats.

A component's hyperparameters are its parameters that have a default (for a class, its constructor's); per-step
inputs (rewards, lengths, entropy, strata, ...) are not preset data. Checks, all before anything is built:
an unknown component is the registry's ValueError listing the valid names; an unknown hyperparameter is a TypeError
listing the valid ones; a value whose type does not match the parameter's annotation or default (int, float, bool,
str, None; an int is also a float) is a TypeError naming the key, the expected and the received type. YAML reads
`3e-4` as a string: write `3.0e-4`. Loss options go through `LossOptions.from_kwargs` (an unknown one is a
TypeError listing the valid ones; a bad value is LossOptions' ValueError).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.option_checks import type_words
from grpo_kernels.options import LOSS_TYPES, LossOptions
from grpo_kernels.registry import Registry
from grpo_kernels.regularizers import REGULARIZERS
from grpo_kernels.rewards import REWARDS
from grpo_kernels.sampling import SAMPLERS
from grpo_kernels.shown import shown
from grpo_kernels.yaml_files import load_yaml

PRESET_DIR = "configs/papers"
PRESET_KEYS = ("name", "paper", "loss", "advantage", "rewards", "sampling", "regularizers", "training", "notes")
REQUIRED_KEYS = ("name", "paper", "loss", "advantage", "rewards")
PAPER_KEYS = ("title", "arxiv", "openreview")
NOT_GIVEN = "not given"  # a training setting the paper does not state
# training setting -> (type, smallest value, whether the smallest is excluded)
TRAINING_KEYS = {
    "num_generations": (int, 2, False),
    "learning_rate": (float, 0.0, True),
    "temperature": (float, 0.0, True),
    "num_iterations": (int, 1, False),
    "max_completion_length": (int, 1, False),
}
LENGTH_HYPERPARAMETERS = {"dapo_overlong": ("max_completion_len", "soft_punish_cache")}  # token counts of rewards
_SCALARS = ("None", "bool", "int", "float", "str")
_SEQUENCES = ("Sequence", "list", "tuple", "Collection")
_ARXIV_ID = re.compile(r"\d{4}\.\d{4,5}")


@dataclass(frozen=True)
class Paper:
    """The paper a preset reproduces: its title and its arXiv id, or its OpenReview forum id where it has none."""

    title: str
    arxiv: str | None = None
    openreview: str | None = None

    @property
    def id(self) -> str:
        """`arXiv:<id>` or `OpenReview:<forum id>`."""
        return f"arXiv:{self.arxiv}" if self.arxiv else f"OpenReview:{self.openreview}"

    @property
    def url(self) -> str:
        if self.arxiv:
            return f"https://arxiv.org/abs/{self.arxiv}"
        return f"https://openreview.net/forum?id={self.openreview}"


@dataclass(frozen=True)
class ComponentConfig:
    """A registered component by name with the hyperparameters the preset sets; `weight` is for rewards only."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float | None = None


@dataclass(frozen=True)
class Training:
    """The paper's training settings; None where the paper gives no value (`"not given"` in the YAML)."""

    num_generations: int | None = None  # G, completions per prompt
    learning_rate: float | None = None
    temperature: float | None = None  # sampling temperature (the loss divides the logits by it too)
    num_iterations: int | None = None  # μ, optimizer updates per rollout batch (PPO epochs)
    max_completion_length: int | None = None  # the paper's generation budget in tokens

    def to_dict(self) -> dict[str, Any]:
        return {k: NOT_GIVEN if getattr(self, k) is None else getattr(self, k) for k in TRAINING_KEYS}


@dataclass(frozen=True)
class Preset:
    """One paper's configuration: loss options and components, validated against the registries."""

    name: str
    paper: Paper
    loss: LossOptions
    advantage: ComponentConfig
    rewards: tuple[ComponentConfig, ...]
    sampling: ComponentConfig | None = None
    regularizers: tuple[ComponentConfig, ...] = ()
    training: Training = Training()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The preset as plain data (loss options that differ from the defaults); `from_dict` gives it back."""
        paper = {k: getattr(self.paper, k) for k in PAPER_KEYS if getattr(self.paper, k) is not None}
        data: dict[str, Any] = {
            "name": self.name,
            "paper": paper,
            "loss": {"loss_type": self.loss.loss_type, **loss_overrides(self.loss)},
            "advantage": {"name": self.advantage.name, **self.advantage.kwargs},
            "rewards": [{"name": r.name, "weight": r.weight, **r.kwargs} for r in self.rewards],
        }
        if self.sampling is not None:
            data["sampling"] = {"name": self.sampling.name, **self.sampling.kwargs}
        if self.regularizers:
            data["regularizers"] = [{"name": r.name, **r.kwargs} for r in self.regularizers]
        data["training"] = self.training.to_dict()
        if self.notes:
            data["notes"] = list(self.notes)
        return data


def rewards_for_budget(preset: Preset, budget: int | None) -> tuple[ComponentConfig, ...]:
    """The preset's rewards with their token lengths (`LENGTH_HYPERPARAMETERS`: DAPO's L_max, L_cache) scaled from
    the paper's generation budget (`training.max_completion_length`) to `budget`, a run's: DAPO's L_max = 20480 of a
    20480-token budget becomes `budget`, and L_cache keeps its share (4096 / 20480 = 0.2), at least 1 token, so the
    overlong penalty fires on a task that generates a few tokens. Unchanged where either budget is None."""
    paper = preset.training.max_completion_length
    if budget is None or paper is None:
        return preset.rewards
    scaled = []
    for reward in preset.rewards:
        names = LENGTH_HYPERPARAMETERS.get(reward.name, ())
        params = hyperparameters(REWARDS.get(reward.name)) if names else {}
        lengths = {n: max(1, round(reward.kwargs.get(n, params[n].default) * budget / paper)) for n in names}
        scaled.append(dataclasses.replace(reward, kwargs={**reward.kwargs, **lengths}))
    return tuple(scaled)


def loss_overrides(options: LossOptions) -> dict[str, Any]:
    """The loss options other than `loss_type` whose values differ from LossOptions' defaults."""
    overrides = {}
    for f in dataclasses.fields(LossOptions):
        value = getattr(options, f.name)
        if f.name != "loss_type" and (isinstance(value, torch.Tensor) or value != f.default):
            overrides[f.name] = value
    return overrides


def hyperparameters(obj: Any) -> dict[str, inspect.Parameter]:
    """The parameters of a component a preset may set: those with a default (for a class, its constructor's)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {
        name: p
        for name, p in inspect.signature(obj).parameters.items()
        if p.default is not inspect.Parameter.empty and p.kind not in variadic
    }


def reshapes_rewards(obj: Any) -> bool:
    """Whether a reward component reads the running `rewards` (it reshapes them) rather than producing a term."""
    return "rewards" in inspect.signature(obj.__call__ if inspect.isclass(obj) else obj).parameters


def available() -> list[str]:
    """The names of the shipped presets (the YAML files' stems), sorted."""
    return sorted(p.name[: -len(".yaml")] for p in _preset_dir().iterdir() if p.name.endswith(".yaml"))


def load(name_or_path: str | os.PathLike) -> Preset:
    """A shipped preset by name, in any case (`load("dapo")`, `load("DAPO")`) or a preset YAML file by path,
    validated. A file that is not UTF-8 YAML without anchors and aliases is a ValueError naming it."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"preset must be a preset name or a YAML path, got {type(name_or_path).__name__}")
    if isinstance(name_or_path, str) and name_or_path.lower() in available():
        name = name_or_path.lower()
        text, where = _preset_dir().joinpath(f"{name}.yaml").read_text(encoding="utf-8"), name
    else:
        path = Path(name_or_path)
        if not path.is_file():
            close = difflib.get_close_matches(str(name_or_path), available(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown preset {shown(str(name_or_path))}{hint}: no such file, and not one of {available()}"
            )
        try:
            text, where = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError as error:
            raise ValueError(f"preset {str(path)!r}: not UTF-8 text (byte {error.start})") from None
    return from_dict(load_yaml(text, f"preset {where!r}"), where=where)


def from_dict(data: Mapping[str, Any], *, where: str | None = None) -> Preset:
    """A preset from plain data (the YAML schema of this module's docstring), validated; `where` names it in errors."""
    if not isinstance(data, Mapping):
        raise TypeError(f"preset {where or ''}: must be a mapping of {list(PRESET_KEYS)}, got {type(data).__name__}")
    where = f"preset {shown(where or data.get('name', ''))}"
    unknown = sorted(set(map(str, data)) - set(PRESET_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {shown(unknown)}; valid keys are {list(PRESET_KEYS)}")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; required keys are {list(REQUIRED_KEYS)}")
    _check_value(f"{where}: name", data["name"], "str")
    rewards = _list(where, "rewards", data["rewards"], allow_empty=False)
    sampling = data.get("sampling")
    return Preset(
        name=data["name"],
        paper=_paper(where, data["paper"]),
        loss=_loss(where, data["loss"]),
        advantage=_component(where, "advantage", ADVANTAGES, data["advantage"]),
        rewards=tuple(_reward(where, i, entry) for i, entry in enumerate(rewards)),
        sampling=None if sampling is None else _component(where, "sampling", SAMPLERS, sampling),
        regularizers=tuple(
            _component(where, f"regularizers[{i}]", REGULARIZERS, entry)
            for i, entry in enumerate(_list(where, "regularizers", data.get("regularizers")))
        ),
        training=_training(where, data.get("training")),
        notes=tuple(_notes(where, data.get("notes"))),
    )


# ------------------------------------------------------------------------------------------------- sections
def _preset_dir() -> Any:
    return resources.files("grpo_kernels").joinpath(PRESET_DIR)


def _mapping(where: str, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: {key} must be a mapping, got {type(value).__name__} {shown(value)}")
    return value


def _list(where: str, key: str, value: Any, allow_empty: bool = True) -> list[Any]:
    if value is None and allow_empty:
        return []
    if not isinstance(value, list) or not (value or allow_empty):
        raise TypeError(f"{where}: {key} must be a {'' if allow_empty else 'non-empty '}list, got {shown(value)}")
    return value


def _paper(where: str, value: Any) -> Paper:
    paper = _mapping(where, "paper", value)
    unknown = sorted(set(paper) - set(PAPER_KEYS))
    if unknown or "title" not in paper:
        raise ValueError(
            f"{where}: paper needs 'title' and may have {list(PAPER_KEYS[1:])}, got keys {shown(list(paper))}"
        )
    for key in PAPER_KEYS:
        hint = ' (quote arXiv ids: "2503.14476")' if key == "arxiv" and isinstance(paper.get(key), float) else ""
        _check_value(f"{where}: paper.{key}", paper.get(key), "str" if key == "title" else "str | None", hint)
    if paper.get("arxiv") is None and paper.get("openreview") is None:
        raise ValueError(f"{where}: paper needs an 'arxiv' id, or an 'openreview' forum id where there is none")
    if paper.get("arxiv") is not None and not _ARXIV_ID.fullmatch(paper["arxiv"]):
        raise ValueError(f"{where}: paper.arxiv must look like '2503.14476', got {shown(paper['arxiv'])}")
    return Paper(**paper)


def _loss(where: str, value: Any) -> LossOptions:
    options = dict(_mapping(where, "loss", value))
    if "loss_type" not in options:
        raise ValueError(f"{where}: loss.loss_type is required, one of {LOSS_TYPES}")
    fields = {f.name: f for f in dataclasses.fields(LossOptions)}
    for key, option in options.items():
        if key in fields:
            _check_value(f"{where}: loss.{key}", option, fields[key].type)
    try:
        return LossOptions.from_kwargs(**options)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: loss: {error}") from None


def _component(where: str, key: str, registry: Registry, value: Any, reserved: tuple[str, ...] = ()) -> ComponentConfig:
    entry = _mapping(where, key, value)
    if not isinstance(entry.get("name"), str):
        raise TypeError(f"{where}: {key} needs a 'name' (a {registry.kind} name), got {shown(dict(entry))}")
    try:
        component = registry.component(entry["name"])
    except ValueError as error:
        raise ValueError(f"{where}: {key}: {error}") from None
    params = hyperparameters(component.obj)
    kwargs = {k: v for k, v in entry.items() if k not in ("name", *reserved)}
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(
            f"{where}: {key}: unknown hyperparameter(s) {shown(unknown)} of {registry.kind} {component.name!r}; "
            f"valid: {sorted(params)}"
        )
    for name, kwarg in kwargs.items():
        annotation = params[name].annotation
        _check_value(f"{where}: {key}.{name}", kwarg, annotation, default=params[name].default)
    return ComponentConfig(component.name, kwargs)


def _reward(where: str, index: int, value: Any) -> ComponentConfig:
    key = f"rewards[{index}]"
    config = _component(where, key, REWARDS, value, reserved=("weight",))
    weight = value.get("weight", 1.0)
    _check_value(f"{where}: {key}.weight", weight, "float")
    if index == 0 and reshapes_rewards(REWARDS.get(config.name)):
        raise ValueError(
            f"{where}: {key}: reward {config.name!r} reshapes the rewards listed before it (it reads `rewards`), "
            "so it cannot come first"
        )
    return dataclasses.replace(config, weight=float(weight))


def _training(where: str, value: Any) -> Training:
    settings = _mapping(where, "training", {} if value is None else value)
    unknown = sorted(set(settings) - set(TRAINING_KEYS))
    if unknown:
        raise ValueError(f"{where}: training: unknown key(s) {shown(unknown)}; valid keys are {list(TRAINING_KEYS)}")
    values = {}
    for key, setting in settings.items():
        kind, low, strict = TRAINING_KEYS[key]
        if setting == NOT_GIVEN:
            continue
        _check_value(f"{where}: training.{key}", setting, f"{kind.__name__} | str")
        if isinstance(setting, str) or not (setting > low if strict else setting >= low):
            bound = f"> {low}" if strict else f">= {low}"
            raise ValueError(f"{where}: training.{key} must be {bound} or {NOT_GIVEN!r}, got {shown(setting)}")
        values[key] = kind(setting)
    return Training(**values)


def _notes(where: str, value: Any) -> list[str]:
    notes = _list(where, "notes", value)
    for i, note in enumerate(notes):
        _check_value(f"{where}: notes[{i}]", note, "str")
    return notes


# ------------------------------------------------------------------------------------------------ type checks
def _split_union(annotation: str) -> list[str]:
    """`a | b[c | d] | None` -> ['a', 'b[c | d]', 'None']: split at the top-level bars."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(annotation):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "|" and depth == 0:
            parts.append(annotation[start:i].strip())
            start = i + 1
    return [*parts, annotation[start:].strip()]


def _expected(annotation: Any, default: Any) -> list[str] | None:
    """The type names a value may have: from the annotation, else from a scalar default; None when unknowable."""
    if annotation is not inspect.Parameter.empty:
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
        return None if re.search(r"\b(Any|Optional|Union)\b", text) else _split_union(text)
    if default is not None and type(default).__name__ in _SCALARS:
        return [type(default).__name__]
    return None


def _matches(value: Any, expected: list[str]) -> bool:
    if value is None:
        return "None" in expected
    if isinstance(value, bool):
        return "bool" in expected
    if isinstance(value, int):
        return "int" in expected or "float" in expected
    if isinstance(value, (float, str)):
        return type(value).__name__ in expected
    if isinstance(value, (list, tuple)):
        return any(part.split("[")[0] in _SEQUENCES for part in expected)
    return any(part not in _SCALARS for part in expected)  # an object (from a dict): only a non-scalar type admits it


def _check_value(where: str, value: Any, annotation: Any, hint: str = "", default: Any = None) -> None:
    """TypeError naming `where`, the expected and the received type when `value` does not fit `annotation`; a
    ValueError for a float that is NaN or ±inf (no preset value needs one)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    expected = _expected(annotation, default)
    if expected is None or _matches(value, expected):
        return
    if isinstance(value, str) and not hint:
        try:
            float(value)
            hint = f" (YAML reads a float without a dot as a string: write {float(value)!r})"
        except ValueError:
            pass
    words = " or ".join(type_words(kind) for kind in expected)
    raise TypeError(f"{where} must be {words}, got {type(value).__name__} {shown(value)}{hint}")

"""One checker per option that several entry points take (the public functions, `LossOptions`, the trainer's
configuration, the TRL and verl drop-ins), so that each says the same thing for the same bad value: a TypeError
for a value of the wrong type, a ValueError for a value out of range (NaN and ±inf included), each naming the
option, its rule and the value. Everything else an entry point checks is its own."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from grpo_kernels.shown import shown


@dataclass(frozen=True)
class OptionRule:
    """An option's type (`kind`: "int" or "float"; an int is a float too, a bool is neither), whether None is
    accepted, and its range: `holds` (False for NaN and ±inf) and the words that state it."""

    kind: str
    optional: bool
    holds: Callable[[float], bool]
    words: str


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


OPTION_RULES: dict[str, OptionRule] = {
    "temperature": OptionRule("float", False, _positive, "> 0 and finite"),
    "logit_scale": OptionRule("float", False, _positive, "> 0 and finite"),
    "final_logit_softcapping": OptionRule("float", True, _positive, "> 0 and finite, or None"),
    "top_k": OptionRule("int", False, lambda v: v >= 0, "an int >= 0 (0: off)"),
    "top_p": OptionRule("float", False, lambda v: 0.0 < v <= 1.0, "in (0, 1] (1.0: off)"),
    "min_p": OptionRule("float", False, lambda v: 0.0 <= v < 1.0, "in [0, 1) (0.0: off)"),
}


def type_words(kind: str, optional: bool = False) -> str:
    """How an error names a type: "an int", "a float or None"."""
    words = {"int": "an int", "float": "a float", "bool": "a bool", "str": "a str", "dict": "a dict"}.get(kind, kind)
    return words + (" or None" if optional else "")


def check_option(name: str, value: object, label: str | None = None) -> None:
    """Option `name`'s type, then its range: the one message for each bad value of it, wherever it comes in
    (`label`: how the caller's API spells the name, e.g. a config's "rollout.top_k")."""
    rule = OPTION_RULES[name]
    if value is None and rule.optional:
        return
    kinds = (int,) if rule.kind == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(
            f"{label or name} must be {type_words(rule.kind, rule.optional)}, got {type(value).__name__} {shown(value)}"
        )
    if not rule.holds(value):
        raise ValueError(f"{label or name} must be {rule.words}, got {shown(value)}")

"""docs/variants.md from the presets and the registries, so that the page cannot drift from the code.

    python -m grpo_kernels.variants_doc > docs/variants.md

One row per paper preset (its loss options and components), then one table per registry (loss types, advantage
estimators, rewards, samplers, regularizers) with each component's hyperparameter defaults, the summary line of
its docstring and its paper, what each component was checked against (`paper_checks.py`), and the preset schema.
tests/test_variants_doc.py fails when the committed page differs from `render()`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from grpo_kernels import presets
from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.paper_checks import CHECKS, LABELS
from grpo_kernels.registry import Registry
from grpo_kernels.regularizers import REGULARIZERS
from grpo_kernels.rewards import REWARDS
from grpo_kernels.sampling import SAMPLERS

COMMAND = "python -m grpo_kernels.variants_doc > docs/variants.md"
NONE = "—"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (pipes escaped, one line)."""
    return " ".join(text.split()).replace("|", "\\|")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _call(name: str, kwargs: dict[str, Any]) -> str:
    """`name(k=v, ...)`, or `name` without arguments."""
    args = ", ".join(f"{key}={_value(value)}" for key, value in kwargs.items())
    return f"`{name}({args})`" if args else f"`{name}`"


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _rewards(preset: presets.Preset) -> str:
    """The reward pipeline: weighted terms joined by +, a reward that reshapes them after an arrow."""
    text = ""
    for reward in preset.rewards:
        term = _call(reward.name, reward.kwargs)
        term = term if reward.weight == 1.0 else f"{_value(reward.weight)}·{term}"
        if not text:
            text = term
        elif presets.reshapes_rewards(REWARDS.get(reward.name)):
            text = f"{text} → {term}"
        else:
            text = f"{text} + {term}"
    return text


def _preset_rows() -> list[list[str]]:
    rows = []
    for name in presets.available():
        p = presets.load(name)
        rows.append(
            [
                f"`{name}`",
                p.name,
                p.paper.title,
                f"[{p.paper.id}]({p.paper.url})",
                _call(p.loss.loss_type, presets.loss_overrides(p.loss)),
                _call(p.advantage.name, p.advantage.kwargs),
                _rewards(p),
                NONE if p.sampling is None else _call(p.sampling.name, p.sampling.kwargs),
                ", ".join(_call(r.name, r.kwargs) for r in p.regularizers) or NONE,
                "<br>".join(p.notes) or NONE,
            ]
        )
    return rows


def _defaults(obj: Any) -> str:
    params = presets.hyperparameters(obj)
    return ", ".join(f"{name}={_value(p.default)}" for name, p in params.items()) or NONE


def _component_rows(registry: Registry) -> list[list[str]]:
    return [
        [f"`{c.name}`", _defaults(c.obj), c.summary, c.paper or NONE] for c in sorted(registry, key=lambda c: c.name)
    ]


def _first_paragraph(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0]


def _checks_intro() -> list[str]:
    return [
        f"Per component (`grpo_kernels/paper_checks.py`), with the labels {', '.join(f'`{x}`' for x in LABELS)}: "
        "official code read at a pinned commit; the paper's page, abstract or a faithful summary; a reference "
        "implementation; mechanism verified but a form or constant from a third-party port; no primary source; a "
        "utility. The last column says what is still unverified and why. The forms that rested on a port were "
        "checked again: GTPO and GRPO-S now standardise over the whole group (the port's within-O± "
        "standardisation gave correct responses negative advantages, against the paper's Fig. 1; it stays as "
        "`normalize='split'`), and the `tic_grpo` preset uses GRPO's advantage, as the paper's abstract describes it.",
    ]


def render() -> str:
    """The whole of docs/variants.md."""
    lines = [
        "# GRPO variants",
        "",
        f"Generated from the paper presets (`grpo_kernels/configs/papers/*.yaml`) and the component registries by "
        f"`{COMMAND}`; do not edit by hand (`tests/test_variants_doc.py` fails when this page is stale). "
        '`grpo_kernels.presets.load("<preset>")` returns a preset as a validated `Preset`.',
        "",
        "## Papers",
        "",
        "Loss: the loss type and the options that differ from `LossOptions`' defaults. Rewards: weighted terms "
        "summed (`+`); a reward after `→` reshapes the sum before it. Notes: what the spec labels unverified or "
        "partial, and caveats.",
        "",
    ]
    header = ("preset", "name", "paper", "id", "loss", "advantage", "rewards", "sampling", "regularizers", "notes")
    lines += _table(header, _preset_rows())
    lines += ["", "## Loss types (`LossOptions.loss_type`)", ""]
    loss_rows = [
        [f"`{n}`", f"`{s.normaliser}`", _first_paragraph(s.term.__doc__), s.paper]
        for n, s in sorted(POLICY_LOSSES.items())
    ]
    lines += _table(("loss_type", "normaliser", "per-token term", "paper"), loss_rows)
    for title, registry in (
        ("Advantage estimators", ADVANTAGES),
        ("Rewards", REWARDS),
        ("Samplers", SAMPLERS),
        ("Regularizers", REGULARIZERS),
    ):
        lines += ["", f"## {title}", ""]
        lines += _table(("name", "hyperparameters (defaults)", "summary", "paper"), _component_rows(registry))
    lines += ["", "## Checked against the papers", "", *_checks_intro(), ""]
    check_rows = [[kind, f"`{name}`", c.status, c.source, c.gap or NONE] for (kind, name), c in CHECKS.items()]
    lines += _table(("kind", "component", "status", "checked against", "unverified, and why"), check_rows)
    lines += ["", "## Preset schema (`grpo_kernels/presets.py`)", "", *presets.__doc__.strip().splitlines()]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.buffer.write(render().encode("utf-8"))


if __name__ == "__main__":
    main()

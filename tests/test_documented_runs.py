"""Every command of README.md and docs/*.md runs to completion, with the step counts written there, and the demo's
numbers that the docs quote are those of the README's demo run.

This is the long form of tests/test_docs_commands.py, which runs the same lines capped at one step: here no cap
(`GRPO_KERNELS_MAX_STEPS` is removed), so a run that breaks at step 559 fails here. A line whose run would not fit
in CI says so in the docs (`# needs: ...`) or is written with fewer steps; nothing is capped behind the reader's back.
A training or comparison without a run directory of its own (the demo, a comparison into a new directory) that
several files hold runs once, with the first of them.

The tests run only with `--documented-runs` (.ci/run's separate step: `python -m pytest -q -n 2 --documented-runs
tests/test_documented_runs.py`); without it they skip saying so. The README's demo then gives the numbers of
docs/trainer.md's passage (`benchmarks.documented_numbers`), which must equal the page's, and the README's comparison
(100 steps) the first rewards of docs/compare.md's runs of the same presets (500 steps, ~40 minutes: too long for CI
whole), which must equal docs/compare.json's curves.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from benchmarks import documented_numbers
from tests.test_docs_commands import FILES, ROOT, _runnable, run_commands

pytestmark = pytest.mark.documented_runs


def _needs_nothing_before(words: list[str]) -> bool:
    """A training or comparison that makes its own new run directory and reads none: run once for every file."""
    commands = (["python", "-m", "grpo_kernels.train"], ["python", "-m", "grpo_kernels.compare"])
    return words[:3] in commands and not any(word in ("--output-dir", "--resume", "--model") for word in words)


def _first_files() -> dict[str, Path]:
    """Each command that needs nothing before it -> the first file that holds it (the one that runs it, whichever
    worker runs the other files)."""
    first: dict[str, Path] = {}
    for path in FILES:
        for command in _runnable(path):
            words = shlex.split(command.text, comments=True) if command.kind == "shell" else []
            if _needs_nothing_before(words):
                first.setdefault(shlex.join(words), path)
    return first


FIRST_FILES = _first_files()


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documented_runs_finish(path, tmp_path, monkeypatch, capsys):
    """The file's commands, in order, in a fresh directory, to completion; for README.md, then the demo's numbers."""
    if not _runnable(path):
        pytest.skip(f"{path.name}: no command CI can run")
    monkeypatch.delenv("GRPO_KERNELS_MAX_STEPS", raising=False)
    run_commands(path, tmp_path, monkeypatch, capsys, lambda words: FIRST_FILES.get(shlex.join(words), path) != path)
    if path.name == "README.md":
        _check_the_demos_numbers(tmp_path)
        _check_the_comparisons_curves(tmp_path)


def _check_the_demos_numbers(directory: Path) -> None:
    demos = sorted((directory / "runs").glob("demo-*"))
    assert len(demos) == 1, f"the README's demo line should make one runs/demo-<timestamp>/, found {demos}"
    numbers = documented_numbers.measure(demos[0])
    (last_step, last), (_, evaluated) = numbers["last_eval"], numbers["evaluate"]
    assert last >= 0.9, f"the demo should end at its best: greedy accuracy {last:.2f} at its last step {last_step}"
    assert round(evaluated, 2) == round(last, 2), (
        f"evaluate of the final checkpoint gives {evaluated:.2f}, the run {last:.2f}"
    )
    fresh = documented_numbers.wrapped(documented_numbers.passage(numbers))
    page = documented_numbers.PAGE.relative_to(ROOT)
    assert documented_numbers.documented() == fresh, (
        f"{page}'s demo numbers differ from a fresh run of the demo: regenerate them with "
        f"`python -m grpo_kernels.train --output-dir runs/demo && python -m benchmarks.documented_numbers runs/demo "
        f"--write`. The fresh run gives:\n{fresh}"
    )


def _check_the_comparisons_curves(directory: Path) -> None:
    """docs/compare.md's runs (500 steps each) begin as the README's comparison of the same presets does: the same
    seed and budget give the same rewards step by step (to the table's three decimals), or compare.md is stale."""
    (fresh,) = sorted((directory / "runs").glob("compare-*/compare.json"))
    fresh_runs = {run["preset"]: run["curve"] for run in json.loads(fresh.read_text())["runs"]}
    documented = {
        run["preset"]: run["curve"] for run in json.loads((ROOT / "docs" / "compare.json").read_text())["runs"]
    }
    for preset, curve in fresh_runs.items():
        theirs = [(step, round(reward, 3)) for step, reward in documented[preset][: len(curve)]]
        ours = [(step, round(reward, 3)) for step, reward in curve]
        differ = next((a for a, b in zip(ours, theirs, strict=True) if a != b), None)
        assert differ is None, (
            f"docs/compare.md's {preset} run differs from a fresh one at step {differ[0]}: rerun the command in "
            "docs/compare.md and copy its compare.md table, compare.json and compare.svg into docs/"
        )

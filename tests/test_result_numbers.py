"""Each performance number of README.md and docs/benchmarks.md is its result file's: the passages that
`benchmarks/result_numbers.py` generates from benchmarks/results/ equal what the pages hold (regenerate them with
`python -m benchmarks.documented_numbers --write`), and the README quotes no CPU or H100 ratio outside them."""

from __future__ import annotations

import re

import pytest

from benchmarks import result_numbers
from tests.test_docs_commands import ROOT


@pytest.mark.parametrize("passage", result_numbers.PASSAGES, ids=lambda p: p.name)
def test_the_page_holds_what_its_result_files_give(passage):
    page = passage.page.relative_to(ROOT)
    assert result_numbers.documented(passage) == result_numbers.generated(passage), (
        f"{page}'s passage {passage.name!r} differs from its result files: `python -m benchmarks.documented_numbers "
        f"--write` regenerates it"
    )


def test_the_readme_quotes_its_ratios_only_inside_the_generated_passages():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for passage in result_numbers.PASSAGES:
        if passage.page.name == "README.md":
            text = text.replace(result_numbers.documented(passage), "")
    assert not re.findall(r"\d+\.\d+× (?:the time|TRL)", text)
    assert not re.findall(r"\d[\d,.]* (?:ms|MiB)\b", text)


def test_a_changed_result_shows(monkeypatch, tmp_path):
    """The check can fail: a result file whose TRL median moved gives another passage."""
    import json

    run = json.loads(result_numbers.TILES_CPU.read_text())
    for record in run["records"]:
        record["vs_trl"] *= 1.5
    changed = tmp_path / result_numbers.TILES_CPU.name
    changed.write_text(json.dumps(run))
    (cpu,) = [p for p in result_numbers.PASSAGES if p.name == "the CPU headline"]
    before = result_numbers.generated(cpu)
    monkeypatch.setattr(result_numbers, "TILES_CPU", changed)
    assert result_numbers.generated(cpu) != before

"""docs/variants.md is the generator's output: it lists every preset and every registered component."""

from pathlib import Path

import grpo_kernels as gk
from grpo_kernels import presets
from grpo_kernels.variants_doc import COMMAND, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "variants.md"


def test_committed_doc_is_the_generators_output():
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/variants.md is stale: run {COMMAND}"


def test_doc_has_a_row_per_preset_and_component():
    text = render()
    names = [*presets.available(), *gk.POLICY_LOSSES]
    for registry in (gk.ADVANTAGES, gk.REWARDS, gk.SAMPLERS, gk.REGULARIZERS):
        names += registry.names()
    for name in names:
        assert f"| `{name}` |" in text, name

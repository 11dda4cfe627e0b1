"""docs/variants.md is the generator's output: it lists every preset and every registered component."""

from pathlib import Path

import grpo_kernels as gk
from grpo_kernels import presets
from grpo_kernels.paper_checks import CHECKS, KINDS, LABELS
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


def test_every_component_says_what_it_was_checked_against():
    registries = (gk.POLICY_LOSSES, gk.ADVANTAGES, gk.REWARDS, gk.SAMPLERS, gk.REGULARIZERS)
    registries = dict(zip(KINDS, registries, strict=True))
    registered = {(kind, name) for kind, registry in registries.items() for name in registry_names(registry)}
    assert set(CHECKS) == registered
    for key, check in CHECKS.items():
        assert check.status in LABELS, key
        assert check.source, key
        if check.status in ("partial", "unverified"):  # these say what is missing and why
            assert check.gap, key
    assert "| advantage | `gtpo` | partial |" in render()


def registry_names(registry) -> list[str]:
    return list(registry) if isinstance(registry, dict) else registry.names()

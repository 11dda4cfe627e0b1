"""docs/api.md's quickstart runs as written, its loss-type table lists every registered loss type, and its function
table gives every public function's signature as it is (every keyword, replay's and `stats=` included)."""

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

import grpo_kernels as gk

API_DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")


def test_quickstart_runs():
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", API_DOC, re.S).group(1)
    exec(compile(block, "docs/api.md quickstart", "exec"), {})


def test_loss_type_table_lists_the_registry():
    listed = set(re.findall(r"^\| `(\w+)` \|", API_DOC, re.M))
    assert set(gk.POLICY_LOSSES) <= listed


SIGNATURE_ROW = re.compile(r"^\| `([\w.]+)\((.*?)\)` \|", re.M)
PUBLIC = (  # every public callable the table must give: grpo_kernels' own, and the hf entry point
    *(name for name in gk.__all__ if inspect.isfunction(getattr(gk, name)) or name in ("GRPOLoss", "SamplingMask")),
    "grpo_kernels.integrations.hf.policy_logprobs",
    "grpo_kernels.presets.load",
    "grpo_kernels.distributed.num_items_in_batch",
)


def _resolve(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module) if module else gk, attribute)


def plain_signature(function) -> str:
    """A signature as the table writes it: names, `*`, defaults (strings in double quotes), no annotations."""
    parts, keyword_only = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        default = (
            ""
            if p.default is p.empty
            else "=" + (json.dumps(p.default) if isinstance(p.default, str) else repr(p.default))
        )
        parts.append(p.name + default)
    return ", ".join(parts)


DOCUMENTED = dict(SIGNATURE_ROW.findall(API_DOC))


@pytest.mark.parametrize("name", PUBLIC)
def test_the_function_table_gives_each_signature_as_it_is(name):
    assert name in DOCUMENTED, f"docs/api.md's function table has no row `{name}(...)`"
    assert DOCUMENTED[name] == plain_signature(_resolve(name)), f"docs/api.md's `{name}` differs from its signature"


def test_the_replay_keywords_and_stats_are_named_where_a_function_takes_them():
    for name in PUBLIC:
        parameters = inspect.signature(_resolve(name)).parameters
        row = next(line for line in API_DOC.splitlines() if line.startswith(f"| `{name}("))
        for keyword in ("top_k", "top_p", "min_p", "sampling_mask", "stats"):
            if keyword in parameters or ("loss_options" in parameters and keyword in ("top_k", "top_p", "min_p")):
                assert f"`{keyword}" in row.split("` | ", 1)[1], f"docs/api.md's `{name}` row does not name {keyword}"

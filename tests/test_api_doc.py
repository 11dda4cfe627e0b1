"""docs/api.md's quickstart runs as written, and its loss-type table lists every registered loss type."""

import re
from pathlib import Path

import grpo_kernels as gk

API_DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")


def test_quickstart_runs():
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", API_DOC, re.S).group(1)
    exec(compile(block, "docs/api.md quickstart", "exec"), {})


def test_loss_type_table_lists_the_registry():
    listed = set(re.findall(r"^\| `(\w+)` \|", API_DOC, re.M))
    assert set(gk.POLICY_LOSSES) <= listed

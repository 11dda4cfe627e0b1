"""The README's quickstart runs as written, and its loss-type table lists every registered loss type."""

import re
from pathlib import Path

import grpo_kernels as gk

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_quickstart_runs():
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", README, re.S).group(1)
    exec(compile(block, "README quickstart", "exec"), {})


def test_loss_type_table_lists_the_registry():
    listed = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    assert set(gk.POLICY_LOSSES) <= listed

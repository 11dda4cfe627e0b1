"""The supported triton range: stated once in pyproject.toml and in `backends`, checked before triton is imported,
and every launch pins FP fusion (triton 3.10 turns it off by default)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from grpo_kernels.kernels import backend as backends

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = sorted(p for p in (ROOT / "grpo_kernels" / "kernels" / "triton").glob("*.py") if p.name != "__init__.py")
check = backends.check_triton_version.__wrapped__  # uncached: each call checks (and warns) again


def test_pyproject_states_the_checked_range():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"triton\b", d)]
    oldest, newest = ".".join(map(str, backends.TRITON_OLDEST)), backends.TRITON_NEWEST_SEEN
    assert spec == f"triton>={oldest.removesuffix('.0')},<{newest[0]}.{newest[1] + 1}", spec


def test_installed_triton_is_supported():
    check()  # the one this environment runs its tests with


@pytest.mark.parametrize("version", ("3.6.0", "3.7.1", "3.9.0", "3.9.1+git1234"))
def test_supported_versions_pass_quietly(version, recwarn):
    check(version)
    assert not recwarn.list


@pytest.mark.parametrize("version", ("3.0.0", "3.5.1", "2.3.1"))
def test_older_triton_is_a_clear_error(version):
    with pytest.raises(RuntimeError, match=rf"needs triton >= 3\.6\.0 .* got triton {re.escape(version)}"):
        check(version)


def test_newer_triton_is_warned_about():
    with pytest.warns(UserWarning, match=r"triton 3\.10\.0 is newer than the newest .* \(3\.9\)"):
        check("3.10.0")


def _launches(path: Path) -> list[ast.Call]:
    """The `kernel[grid](...)` calls of a module."""
    return [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
    ]


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_every_launch_pins_fp_fusion(path):
    """Each `kernel[grid](...)` launch passes enable_fp_fusion=True: the compiled code must not change with a
    triton whose default differs. (A module may launch nothing itself: the lean tiles go through `ops.py`.)"""
    for call in _launches(path):
        pinned = [k for k in call.keywords if k.arg == "enable_fp_fusion"]
        assert pinned and isinstance(pinned[0].value, ast.Constant) and pinned[0].value.value is True, (
            f"{path.name}:{call.lineno}: launch without enable_fp_fusion=True"
        )


def test_every_kernel_module_launches_its_kernels():
    """The launch check above sees launches: each module that defines `@triton.jit` kernels launches them, or holds
    device functions that a launching module imports (`row_stats.py`)."""
    kernel_modules = [p for p in LAUNCHERS if "@triton.jit" in p.read_text()]
    launching = [p for p in kernel_modules if _launches(p)]
    imported = {p for p in kernel_modules if any(f"kernels.triton.{p.stem} import" in q.read_text() for q in launching)}
    assert launching
    assert all(p in launching or p in imported for p in kernel_modules), [
        p.name for p in kernel_modules if p not in launching and p not in imported
    ]

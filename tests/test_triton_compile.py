"""Every Triton kernel compiled for sm_80 and sm_90a, without a GPU, with the launchers' own specialisations, and held
to: no spills, at most 64 registers, 128-bit global loads on the logits stream, and main-loop SASS instructions per KB
of logits within the budgets of `benchmarks.static_report.BUDGETS`.

The compile runs `python -m benchmarks.static_report --subset ci` in a subprocess: conftest turns the interpreter on in
this process, which replaces the JIT functions. How launches are recorded from the real launchers (on meta tensors) and
specialised like `JITFunction.run`, and how instructions per KB are counted (the innermost loop, i.e. backward branch,
with the most LDGs: its instructions × num_warps × 1024 / bytes its LDGs load per iteration), is in that module's
docstring. The `ci` subset, per architecture: the forward and backward with entropy and the fused clip loss at every
dtype and both vocabularies (V = 151,936 and 151,939), and every other case (soft-cap, statistics, each policy epilogue
and KL estimator) at bf16 and V = 151,936; about a minute on two cores. `python -m benchmarks.static_report` runs the
full matrix (all cases × 3 dtypes × 2 vocabularies × 2 archs) into benchmarks/results/static/<triton version>.json.

Every launch the API can reach (`benchmarks.launch_space`: every dtype × each subset of the statistics, entropy ×
soft-capping, each epilogue and KL estimator) is compiled for sm_90a against the installed triton and against each
older one of `benchmarks.older_triton.OLDER_TRITONS` (3.6.0 and 3.7.1: torch 2.10/2.11's and 2.12/2.13's pins), in a
subprocess with that triton first on PYTHONPATH; .ci/run installs them with `pip install --no-deps --target`, and
where one is absent its test skips saying so. On triton 3.6 the soft-capped kernels once failed here
(`tl.math.fdiv(..., approx=True)`: the keyword is 3.9's), and on 3.6 and 3.7 the float32 forward with the mean logit
and top-1 (a thread-locality pass).

`SHORTFALLS` lists what the kernels miss, each with its measured number, as strict xfails: the day a kernel meets its
budget the test XPASSes, which fails, and the entry must go (`python -m benchmarks.static_report --subset ci
--shortfalls` prints the table for the kernels in the tree). It is empty: the rewritten kernels meet every check. The
kernels of a34c933 (one program per row, three block reductions per 4096-wide tile) missed 68 of these cases, e.g.
sm_90a bf16 forward with entropy at 312 instructions/KB (363 and 16-bit loads with V = 151,939).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import launch_space, older_triton, static_report

ROOT = Path(__file__).resolve().parent.parent
ITEMS = static_report.matrix("ci")

# (check, "arch/case/dtype/vocab") -> what was measured. Checks: "spills", "registers", "vector_loads", "budget".
SHORTFALLS: dict[tuple[str, str], str] = {}


def _params(check: str) -> list:
    out = []
    for arch, case, dtype, vocab in ITEMS:
        key = f"{arch}/{case}/{dtype}/{vocab}"
        marks = [pytest.mark.xfail(strict=True, reason=SHORTFALLS[check, key])] if (check, key) in SHORTFALLS else []
        out.append(pytest.param((arch, case, dtype, vocab), id=key, marks=marks))
    return out


STATIC = pytest.mark.xdist_group("static_report")  # the tests reading `report` share one worker, and so one report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    try:
        missing = static_report.missing_tools()
    except ImportError as error:
        pytest.skip(f"triton is not importable: {error}")
    if missing:
        pytest.skip(f"{', '.join(missing)} not found (bundled with the triton wheel under triton/backends/nvidia/bin/)")
    out = tmp_path_factory.mktemp("static") / "static.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "benchmarks.static_report", "--subset", "ci", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


def _kernels(report: dict, item: tuple[str, str, str, str]) -> list[dict]:
    arch, case, dtype, vocab = item
    rows = [r for r in report["kernels"] if (r["arch"], r["case"], r["dtype"], r["vocab"]) == item]
    assert rows, f"no kernel compiled for {item}"
    return rows


def _describe(row: dict) -> str:
    return f"{row['kernel']} ({row['num_warps']} warps, constexprs {row['constexprs']})"


@STATIC
def test_every_kernel_is_launched_by_a_case(report):
    assert report["uncovered_kernels"] == [], (
        f"no case of benchmarks/static_report.py launches {report['uncovered_kernels']}: add one to cases()"
    )


@STATIC
def test_every_case_is_compiled(report):
    compiled = {(r["arch"], r["case"], r["dtype"], r["vocab"]) for r in report["kernels"]}
    assert set(ITEMS) <= compiled, f"not compiled: {sorted(set(ITEMS) - compiled)}"


@STATIC
@pytest.mark.parametrize("item", _params("spills"))
def test_no_spills(report, item):
    for row in _kernels(report, item):
        spilled = row["spill_store_bytes"] + row["spill_load_bytes"]
        assert spilled == 0, f"{_describe(row)}: {row['spill_store_bytes']} B spill stores, " + (
            f"{row['spill_load_bytes']} B spill loads, {row['stack_bytes']} B stack frame"
        )


@STATIC
@pytest.mark.parametrize("item", _params("registers"))
def test_registers(report, item):
    for row in _kernels(report, item):
        assert row["registers"] <= static_report.MAX_REGISTERS, f"{_describe(row)}: {row['registers']} registers"


@STATIC
@pytest.mark.parametrize("item", _params("vector_loads"))
def test_logits_loads_are_128_bit(report, item):
    for row in _kernels(report, item):
        if row["reads_logits"]:
            assert row["loop_ldg_bits"], f"{_describe(row)}: no global load found in its main loop"
            assert set(row["loop_ldg_bits"]) == {128}, (
                f"{_describe(row)}: main-loop LDG widths (bits) {row['loop_ldg_bits']}, want all 128"
            )


@STATIC
@pytest.mark.parametrize("item", _params("budget"))
def test_main_loop_instructions_per_kb(report, item):
    for row in _kernels(report, item):
        if row["reads_logits"]:
            key = static_report.budget_key(row["kernel"], row["case"])
            assert row["budget"] is not None, f"{_describe(row)}: no budget for {key} in static_report.BUDGETS"
            assert row["instructions_per_kb"] <= row["budget"], (
                f"{_describe(row)}: {row['instructions_per_kb']} main-loop instructions per KB of logits "
                f"({row['loop_instructions']} per iteration of {row['bytes_per_iteration']} B), budget {row['budget']}"
            )


@pytest.fixture(scope="module", params=("installed", *older_triton.OLDER_TRITONS))
def older_report(request, tmp_path_factory) -> dict:
    version, path = request.param, older_triton.older_triton_path(request.param)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if version != "installed":
        if not (path / "triton" / "__init__.py").exists():
            install = f"pip install --no-deps --target {path} triton=={version}"
            pytest.skip(f"triton {version} is not installed under {path}: {install}")
        env["PYTHONPATH"] = os.pathsep.join([str(path), env["PYTHONPATH"]])
    out = tmp_path_factory.mktemp("older") / f"{version}.json"
    command = [sys.executable, "-m", "benchmarks.older_triton", "--jobs", "2", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} with triton {version} failed:\n{done.stderr[-6000:]}"
    result = json.loads(out.read_text())
    imported = f"triton {result['triton']} from {result['triton_path']}"
    assert version in ("installed", result["triton"]), f"the subprocess imported {imported}"
    return result


def test_every_reachable_launch_compiles(older_report):
    launches = older_report["launches"]
    assert {tuple(item) for item in older_report["items"]} == set(launch_space.matrix(older_triton.ARCHS))
    assert launches, "nothing was compiled"
    failed = [r for r in launches if r["error"] is not None]
    named = [f"{r['arch']}/{r['case']}/{r['dtype']}/{r['vocab']} {r['kernel']}: {r['error']}" for r in failed[:3]]
    heading = f"{len(failed)} of {len(launches)} launches do not compile on triton {older_report['triton']}"
    assert not failed, heading + ":\n" + "\n".join(named)

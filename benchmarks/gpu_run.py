"""The Python half of `benchmarks/run_gpu.sh`: the machine's record, the report over a run's folder, and a pytest
plugin that lets a suite cut short by its timeout keep what it measured.

    python -m benchmarks.gpu_run env OUTDIR      # OUTDIR/env.json, env.md, nvidia-smi.txt; which peers will be skipped
    python -m benchmarks.gpu_run report OUTDIR   # OUTDIR/bench/benchmarks.{json,md} + plots, OUTDIR/SUMMARY.md
    pytest -p benchmarks.gpu_run benchmarks/...  # (run_gpu.sh's suites) the plugin

The report merges the suites' pytest-benchmark JSON (OUTDIR/bench/bench_*.json, one per bench file, each run
separately so that a timeout loses one file's results at most) into benchmarks.json, and writes its tables and
plots with `benchmarks.report` next to it; `python -m benchmarks.interleaved` wrote its own table beside its JSON.
SUMMARY.md gathers the machine, every step's status (OUTDIR/steps.tsv), the parity summary and the tables.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "liger-kernel",
    "trl",
    "accelerate",
    "datasets",
    "peft",
    "numpy",
    "pytest",
    "pytest-benchmark",
    "matplotlib",
)
PEERS = {"liger_kernel": "liger-kernel", "trl": "trl"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(*args: str) -> str | None:
    """A tool's output, or None when it is not there or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def environment() -> dict:
    import torch

    import grpo_kernels

    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    nvcc = _command("nvcc", "--version")
    return dict(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        capability=".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        memory_gib=round(props.total_memory / 2**30, 1) if props else None,
        sm_count=props.multi_processor_count if props else None,
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if cuda else None,
        nvcc=nvcc.strip().splitlines()[-1] if nvcc else None,
        driver=(_command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") or "").strip() or None,
        grpo_kernels=grpo_kernels.__version__,
        extension_built=importlib.util.find_spec("grpo_kernels._C") is not None,
        git_commit=(_command("git", "rev-parse", "HEAD") or "").strip() or None,
        packages={p: _version(p) for p in PACKAGES},
    )


def env(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    info = environment()
    (outdir / "env.json").write_text(json.dumps(info, indent=1))
    (outdir / "env.md").write_text(env_markdown(info))
    smi = _command("nvidia-smi")
    (outdir / "nvidia-smi.txt").write_text(smi or "nvidia-smi: not found or failed\n")
    print(env_markdown(info))
    for module, package in PEERS.items():
        if importlib.util.find_spec(module) is None:
            print(f"{package} is not installed: its benchmark cases will be skipped (WHEELS=dir to carry it)")


def env_markdown(info: dict) -> str:
    keys = (
        "device",
        "capability",
        "memory_gib",
        "sm_count",
        "driver",
        "torch",
        "torch_cuda",
        "cudnn",
        "nvcc",
        "python",
        "grpo_kernels",
        "extension_built",
        "git_commit",
    )
    rows = [f"| {k} | {info.get(k)} |" for k in keys]
    rows += [f"| {k} | {v or 'not installed'} |" for k, v in info["packages"].items()]
    return "\n".join(["| | |", "|---|---|", *rows]) + "\n"


def merge(bench: Path) -> Path | None:
    """OUTDIR/bench/bench_*.json -> OUTDIR/bench/benchmarks.json (pytest-benchmark's layout)."""
    parts = [json.loads(p.read_text()) for p in sorted(bench.glob("bench_*.json"))]
    if not parts:
        return None
    merged = dict(parts[0], benchmarks=[b for part in parts for b in part.get("benchmarks", [])])
    path = bench / "benchmarks.json"
    path.write_text(json.dumps(merged, indent=1))
    return path


def report(outdir: Path) -> None:
    from benchmarks import report as tables

    bench = outdir / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    merged = merge(bench)
    rows = tables.load(str(merged)) if merged else []
    note = "" if rows else "No timed cases in this run's suites (not run, or run with --benchmark-disable).\n"
    (bench / "benchmarks.md").write_text(tables.markdown(rows) or note)
    written = [bench / "benchmarks.md", *tables.plots(rows, bench)] if rows else [bench / "benchmarks.md"]
    summary = outdir / "SUMMARY.md"
    summary.write_text(summary_markdown(outdir))
    for path in [*written, summary]:
        print(path)


def summary_markdown(outdir: Path) -> str:
    """The machine, the steps, the parity summary and the benchmark tables, in one file."""
    out = ["# GPU run", ""]
    if (outdir / "env.md").exists():
        out += ["## Machine", "", (outdir / "env.md").read_text()]
    if (outdir / "steps.tsv").exists():
        out += ["## Steps", "", "| step | status | exit | seconds | log | ended |", "|---|---|---|---|---|---|"]
        out += [f"| {' | '.join(line.split(chr(9)))} |" for line in (outdir / "steps.tsv").read_text().splitlines()]
        out.append("")
    if (outdir / "skipped.txt").exists():
        out += ["Skipped for lack of time:", "", (outdir / "skipped.txt").read_text()]
    parity = outdir / "parity" / "parity.md"
    if parity.exists():
        out += ["## Parity (float64 oracle)", "", _nested(parity.read_text().split("\n## Every quantity")[0])]
    for title, path in (
        ("Host time per call (tiny shapes)", outdir / "host" / "host.md"),
        ("The public API compiled against eager", outdir / "compiled" / "compiled_step.md"),
        ("Benchmarks against TRL (interleaved)", outdir / "bench" / "interleaved-trl.md"),
        ("Benchmark suites", outdir / "bench" / "benchmarks.md"),
        ("Sampling replay against the plain step", outdir / "bench" / "sampling_replay.md"),
    ):
        if path.exists():
            out += [f"## {title}", "", _nested(path.read_text())]
    return "\n".join(out) + "\n"


def _nested(text: str) -> str:
    """A markdown file's headings two levels down, under a section of the summary."""
    return "\n".join("##" + line if line.startswith("#") else line for line in text.splitlines())


def failure_line(r: dict) -> str:
    """One parity record that failed, in words."""
    case = (
        f"{r['op']}" + ("" if r["loss"] == "-" else f"[{r['loss']}]") + f" {r['dtype']} {r['quantity']} {r['backend']}"
    )
    if "error" in r:
        return f"{case}: {r['error']}"
    plain = "" if r.get("plain_rel") is None else f" = max(rtol {r['rtol']:g}, 2 x plain {r['plain_rel']:.3g})"
    return f"{case}: max error {r['err']:.3g} = {r['rel']:.3g} x scale {r['scale']:.3g} > {r['tol']:.3g}{plain}"


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if "error" in r:
        return "**error**"
    return f"{r['rel']:.1e}" + ("" if r["ok"] else " **FAIL**")


def parity_markdown(header: dict, records: list[dict]) -> str:
    """`benchmarks.gpu_parity`'s table: a summary per (op, loss, dtype), the worst error / tolerance per backend,
    then every quantity."""
    backend_names = list(dict.fromkeys(r["backend"] for r in records))
    failures = [r for r in records if not r["ok"]]
    out = [
        f"# Float64-oracle parity on {header['device']} (torch {header['torch']})",
        "",
        f"Size {header['size']}: B = {header['B']}, T = {header['T']}, V = {header['V']:,}, H = {header['H']:,} "
        f"(fused ops). A cell is max |ours − oracle| / max |oracle| of the tensor; `plain` is the same for a plain "
        f"same-dtype implementation (materialised logits, log_softmax, autograd) in the same run. A quantity passes "
        f"within max(RTOL, 2 × plain); RTOL (tests/conftest.py): "
        f"{', '.join(f'{k} {v:g}' for k, v in header['rtol'].items())}.",
        "",
        f"**{len(records) - len(failures)} of {len(records)} checks within tolerance"
        + (f"; {len(failures)} FAILED.**" if failures else ".**"),
        "",
    ]
    out += [f"- FAILED: {failure_line(r)}" for r in failures]
    out += [
        "",
        "## Worst error / tolerance per case (tolerance: max(RTOL, 2 × plain))",
        "",
        f"| op | loss | dtype | {' | '.join(backend_names)} |",
        f"|---|---|---|{'---|' * len(backend_names)}",
    ]
    groups: dict[tuple, dict[str, list]] = {}
    for r in records:
        groups.setdefault((r["op"], r["loss"], r["dtype"]), {}).setdefault(r["backend"], []).append(r)
    for (op, loss, dtype), by_backend in groups.items():
        cells = []
        for b in backend_names:
            rs = by_backend.get(b, [])
            bad = [r for r in rs if "error" in r]
            worst = max((r["rel"] / r["tol"] for r in rs if "rel" in r), default=None)
            cells.append(
                "**error**" if bad else "—" if worst is None else f"{worst:.2g}" + ("" if worst <= 1 else " **FAIL**")
            )
        out.append(f"| {op} | {loss} | {dtype} | {' | '.join(cells)} |")
    out += [
        "",
        "## Every quantity (error / scale)",
        "",
        f"| op | loss | dtype | quantity | rtol | plain | {' | '.join(backend_names)} |",
        f"|---|---|---|---|---|---|{'---|' * len(backend_names)}",
    ]
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows.setdefault((r["op"], r["loss"], r["dtype"], r["quantity"]), {})[r["backend"]] = r
    for (op, loss, dtype, quantity), by_backend in rows.items():
        rtol = next((r["rtol"] for r in by_backend.values() if "rtol" in r), None)
        plain = next((r["plain_rel"] for r in by_backend.values() if r.get("plain_rel") is not None), None)
        cells = " | ".join(_cell(by_backend.get(b)) for b in backend_names)
        row = f"| {op} | {loss} | {dtype} | {quantity} | {'' if rtol is None else f'{rtol:g}'} | "
        out.append(row + f"{'—' if plain is None else f'{plain:.1e}'} | {cells} |")
    return "\n".join(out) + "\n"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Before pytest-benchmark saves its JSON, drop the case that an interrupt (the step's timeout sends SIGINT) left
    without a single round: pytest-benchmark would fail on its empty statistics and save nothing."""
    bench_session = getattr(session.config, "_benchmarksession", None)
    if bench_session is not None:
        bench_session.benchmarks[:] = [b for b in bench_session.benchmarks if b]
    yield


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("env", "report"):
        sys.exit("usage: python -m benchmarks.gpu_run env|report OUTDIR")
    {"env": env, "report": report}[argv[0]](Path(argv[1]))


if __name__ == "__main__":
    main()

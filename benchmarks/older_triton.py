"""Every Triton launch the API can reach compiled for sm_90a, without a GPU, against an older triton than the
installed one (or against the installed one, with no other on PYTHONPATH).

    pip install --no-deps --target ~/.cache/grpo-kernels/triton/3.6.0 triton==3.6.0
    PYTHONPATH=~/.cache/grpo-kernels/triton/3.6.0 python -m benchmarks.older_triton --out FILE

torch 2.10 and 2.11 pin triton 3.6, while CI runs the newest triton, whose interpreter compiles nothing: a triton API
the kernels use that an older release lacks (as `tl.math.fdiv(..., approx=True)`, new in 3.9), or a pass of an older
release that fails on one configuration (3.6 and 3.7's thread-locality pass on the float32 forward with the mean logit
and top-1), shows only here. The launches are the launchers' own, for every configuration of
`benchmarks.launch_space`, recorded and specialised as in `benchmarks.static_report`; each is only compiled (PTX and
cubin), since the budgets there are measured with the newest triton. The report lists every launch with the
compiler's error, or None. tests/test_triton_compile.py runs this in a subprocess for the installed triton and, with
the older triton first on PYTHONPATH, for each version in `OLDER_TRITONS` installed under `older_triton_path`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks import launch_space, static_report

OLDER_TRITONS = ("3.6.0", "3.7.1")  # torch 2.10 / 2.11's pin (the oldest the backend accepts), 2.12 / 2.13's
ARCHS = ("sm_90a",)


def older_triton_path(version: str) -> Path:
    """The folder `pip install --no-deps --target <folder> triton==<version>` filled (.ci/run does): under
    $GRPO_KERNELS_TRITON_WHEELS, else ~/.cache/grpo-kernels/triton."""
    root = os.environ.get("GRPO_KERNELS_TRITON_WHEELS") or Path.home() / ".cache" / "grpo-kernels" / "triton"
    return Path(root) / version


def distinct_launches(archs: tuple[str, ...]) -> list[tuple[tuple[str, str, str, str], list[int]]]:
    """(item, indices of its launches to compile) for each item of `launch_space.matrix(archs)`: a launch whose
    specialisation (kernel, signature, constexprs, attributes, options) an earlier one had is compiled once."""
    seen, out = set(), []
    for item in launch_space.matrix(archs):
        arch, case, dtype, vocab = item
        fresh = []
        for index, launch in enumerate(launch_space.launches_of(case, dtype, vocab)):
            key = (launch.kernel.__name__, repr(static_report.specialise(launch, static_report.ARCHS[arch])))
            if key not in seen:
                seen.add(key)
                fresh.append(index)
        out.append((item, fresh))
    return out


def compile_launches(arch: str, case: str, dtype: str, vocab: str, indices: list[int] | None = None) -> list[dict]:
    """One row per launch of the case (those at `indices`, default all), compiled for `arch`, with the compiler's
    error (None when it compiled)."""
    rows = []
    for index, launch in enumerate(launch_space.launches_of(case, dtype, vocab)):
        if indices is not None and index not in indices:
            continue
        row = {"arch": arch, "kernel": launch.kernel.__name__, "case": case, "dtype": dtype, "vocab": vocab}
        try:
            static_report.compile_launch(launch, static_report.ARCHS[arch])
            row["error"] = None
        except Exception as error:  # noqa: BLE001 - recorded: the report names it and the test fails on it
            root = error
            while root.__cause__ is not None:  # a CompilationError per jit function it went through
                root = root.__cause__
            row["error"] = f"{type(root).__name__}: {root}"[-2000:]
        rows.append(row)
    return rows


def _worker(job: tuple[tuple[str, str, str, str], list[int]]) -> list[dict]:
    return compile_launches(*job[0], job[1])


def report(jobs: int) -> dict:
    import triton

    plan = distinct_launches(ARCHS)
    work = sorted((job for job in plan if job[1]), key=lambda job: -len(job[1]))  # the longest first
    return {
        "triton": triton.__version__,
        "triton_path": str(Path(triton.__file__).parent),
        "command": "python -m benchmarks.older_triton",
        "items": [list(item) for item, _ in plan],
        "launches": static_report.run(work, jobs, ARCHS, worker=_worker, item_arch=lambda job: job[0][0]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = report(args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    failed = sum(row["error"] is not None for row in result["launches"])
    launches = len(result["launches"])
    print(f"triton {result['triton']}: {launches} launches, {failed} failed -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Benchmark harness: `--bench-size smoke|cpu|gpu` picks the shapes (default: gpu with CUDA, else cpu); each case
records its median time through pytest-benchmark and, in `extra_info`, its shape, median time, tokens/s, floor and
peak extra memory (skipped under --benchmark-disable and for the smoke size, which CI runs as a correctness check)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cases
from benchmarks.shapes import SIZES


def pytest_addoption(parser):
    parser.addoption("--bench-size", choices=sorted(SIZES), default=None, help="benchmark shapes (see shapes.py)")


def _size(config) -> str:
    return config.getoption("--bench-size") or ("gpu" if torch.cuda.is_available() else "cpu")


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        bench = metafunc.function.__name__.removeprefix("bench_")
        shapes = [s for s in SIZES[_size(metafunc.config)] if s.measured_by(bench)]
        metafunc.parametrize("shape", shapes, ids=[s.name for s in shapes])


_floors: dict[tuple, float] = {}  # (bench, shape, mode) -> seconds: timed once per run, shared by the providers


def _floor_seconds(bench: str, shape, mode: str, data: dict) -> float:
    """`cases.floor_seconds`, timed once per (bench, shape, mode) in this run."""
    key = (bench, shape, mode)
    if key not in _floors:
        _floors[key] = cases.floor_seconds(bench, mode, data)
    return _floors[key]


@pytest.fixture
def bench_size(request) -> str:
    """The --bench-size of this run."""
    return _size(request.config)


@pytest.fixture
def measure(benchmark, request):
    """measure(bench, provider, shape, mode): time the case, record its figures."""

    def run(bench: str, provider: str, shape, mode: str) -> None:
        reason = cases.skip_reason(bench, provider)
        if reason:
            pytest.skip(reason)
        data = cases.inputs(shape)
        step = cases.step(bench, provider, shape, mode, data)
        size = _size(request.config)
        benchmark.extra_info.update(cases.case_info(bench, provider, shape, mode, size))
        rounds = {"smoke": 1, "cpu": 2, "gpu": 5}[size]
        benchmark.pedantic(step, setup=lambda: cases.restore(data), rounds=rounds, warmup_rounds=1)
        if not benchmark.disabled:
            median = benchmark.stats.stats.median
            benchmark.extra_info.update(median_s=median, tokens_per_s=shape.N / median)
        if not benchmark.disabled and size != "smoke":
            benchmark.extra_info["floor_s"] = _floor_seconds(bench, shape, mode, data)
            benchmark.extra_info["peak_extra_bytes"] = cases.peak_extra_bytes(bench, provider, shape, mode, data)

    return run

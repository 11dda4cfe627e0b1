"""Benchmark harness: `--bench-size smoke|cpu|gpu` picks the shapes (default: gpu with CUDA, else cpu); each case
records its median time through pytest-benchmark and, in `extra_info`, its shape, median time, tokens/s, floor and
peak extra memory (skipped under --benchmark-disable and for the smoke size, which CI runs as a correctness check)."""

from __future__ import annotations

import time

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


def _best_seconds(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if cases.device().type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


_floors: dict[tuple, float] = {}  # (bench, shape, mode) -> seconds: timed once per run, shared by the providers


def _floor_seconds(bench: str, shape, mode: str, data: dict) -> float:
    """The physical floor timed in this run: the lm_head GEMMs (fused cases) or a copy of the bytes the logits-level
    loss must move (read the logits twice and write the gradient once; forward: read once). Outputs go to buffers
    allocated once, so the floor times no page faults or allocator work."""
    key = (bench, shape, mode)
    if key not in _floors:
        _floors[key] = _time_floor(bench, mode, data)
    return _floors[key]


def _time_floor(bench: str, mode: str, data: dict) -> float:
    if bench == "grpo_loss":
        logits = data["pristine"]
        moves = 3 if mode == "fwd_bwd" else 1
        out = torch.empty_like(logits)
        return moves / 2 * _best_seconds(lambda: out.copy_(logits))  # a copy reads and writes: 2 moves
    h, w = data["hidden"].detach().flatten(0, 1), data["weight"].detach()
    logits, dh, dw = h.new_empty(h.shape[0], w.shape[0]), torch.empty_like(h), torch.empty_like(w)
    gemms = [lambda: torch.mm(h, w.T, out=logits)]
    if mode == "fwd_bwd":
        gemms += [lambda: torch.mm(logits, w, out=dh), lambda: torch.mm(logits.T, h, out=dw)]
    return sum(_best_seconds(g) for g in gemms)


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
        device = cases.device()
        benchmark.extra_info.update(
            bench=bench,
            provider=provider,
            mode=mode,
            shape=shape.name,
            N=shape.N,
            V=shape.V,
            H=shape.H,
            loss=shape.loss,
            dtype=str(shape.dtype),
            size=size,
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        )
        rounds = {"smoke": 1, "cpu": 2, "gpu": 5}[size]
        benchmark.pedantic(step, setup=lambda: cases.restore(data), rounds=rounds, warmup_rounds=1)
        if not benchmark.disabled:
            median = benchmark.stats.stats.median
            benchmark.extra_info.update(median_s=median, tokens_per_s=shape.N / median)
        if not benchmark.disabled and size != "smoke":
            benchmark.extra_info["floor_s"] = _floor_seconds(bench, shape, mode, data)
            benchmark.extra_info["peak_extra_bytes"] = cases.peak_extra_bytes(bench, provider, shape, mode, data)

    return run

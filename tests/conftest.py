"""Test setup: Triton runs under its CPU interpreter when no GPU is present; one tolerance table for all tests."""

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    assert "triton" not in sys.modules, "TRITON_INTERPRET must be set before triton is imported"
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n N` workers share the cores: each takes its share of intra-op threads
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

from grpo_kernels.kernels import backend as backends  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ("torch", "triton") + (
    ("cuda",) if torch.cuda.is_available() and importlib.util.find_spec("grpo_kernels._C") else ()
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Relative tolerance by input dtype: max |actual − expected| <= RTOL · max(max |expected|, 1e-6 ... see assert_close)
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "", naive: torch.Tensor | None = None
) -> None:
    """Max abs error relative to the largest expected magnitude (the tensor's scale), at the input dtype's rtol.

    Elementwise relative error is meaningless for entries that are 0 by construction (masked rows) or tiny
    softmax tails; the scale-relative error is what a float32 accumulation guarantees. For bf16/fp16, `naive`
    (the same quantity from plain PyTorch in that dtype) also admits up to twice its own error (style guide).
    """
    if naive is not None and dtype in (torch.bfloat16, torch.float16):
        naive_err = (naive.detach().double().cpu() - expected.detach().double().cpu()).abs().max()
        if (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().max() <= 2 * naive_err:
            return
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() == torch.isfinite(expected).all(), f"{name}: non-finite values differ"
    scale = expected.abs().max().clamp(min=1e-6) if expected.numel() else torch.tensor(1.0)
    err = (actual - expected).abs().max() if expected.numel() else torch.tensor(0.0)
    assert err <= RTOL[dtype] * scale, f"{name}: max error {err:.3g} > {RTOL[dtype]:g} x scale {scale:.3g}"


@pytest.fixture
def launches():
    """The launch counter, reset: tests assert the requested backend ran (or that nothing ran)."""
    backends.launches.clear()
    return backends.launches


def pytest_addoption(parser):
    parser.addoption(
        "--documented-runs",
        action="store_true",
        help="run the docs' commands to completion (tests/test_documented_runs.py: minutes; a step of .ci/run)",
    )


def pytest_configure(config):
    """Under xdist (`-n`), tests marked `xdist_group` run on one worker (`--dist loadgroup`, the rest balanced as
    by `load`): a module fixture that compiles for minutes is then built once, not once per worker."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


def pytest_collection_modifyitems(config, items):
    if config.getoption("--documented-runs"):
        return
    skip = pytest.mark.skip(reason="the documented runs take minutes: pass --documented-runs (a step of .ci/run)")
    for item in items:
        if "documented_runs" in item.keywords:
            item.add_marker(skip)

"""Backend names, "auto" resolution and a launch counter (tests read it to prove which backend ran)."""

from __future__ import annotations

import importlib.util
import os
from collections import Counter

import torch

from grpo_kernels.vocab import cuda

BACKENDS = ("auto", "torch", "triton", "cuda")

launches: Counter[str] = Counter()  # backend name (and "fused_epilogue") -> vocabulary passes launched


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """Whether Triton can run on `device`, and why not when it cannot."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (
        f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before triton is imported; "
        f"got {device.type} tensors"
    )


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn the user's `backend` into a concrete one, or raise a clear error; never falls back silently."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        ok, why = triton_usable(device)
        if not ok:
            raise RuntimeError(why)
    if backend == "cuda":
        ok, why = cuda.cuda_usable(device)
        if not ok:
            raise RuntimeError(why)
    return backend

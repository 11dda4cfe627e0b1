"""The backends: one capability record each (what it computes and where its kernels live), "auto" resolution, the
supported triton versions and a launch counter (tests read it to prove which backend ran). `kernels/README.md`
says how to add one."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_kernels.kernels import cuda

launches: Counter[str] = Counter()  # backend name (and "fused_epilogue") -> vocabulary passes launched

# The triton versions the Triton backend supports (pyproject.toml states the same range). Oldest: 3.6.0, the one
# torch 2.10 and 2.11 pin (the lent GPU machine runs torch 2.11); torch 2.12 pins 3.7.0, torch 2.13 3.7.1. Newest
# seen: 3.9 (its interpreter runs the tests on CPU). Triton 3.10 turns FP fusion off by default; every launch
# pins `enable_fp_fusion=True`, so a newer triton is warned about, not refused.
TRITON_OLDEST = (3, 6, 0)
TRITON_NEWEST_SEEN = (3, 9)


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """Whether Triton can run on `device`, and why not when it cannot."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    check_triton_version()
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (
        f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before triton is imported; "
        f"got {device.type} tensors"
    )


def _always(device: torch.device) -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Capabilities:
    """What one backend computes, and the modules that compute it (imported on first use). `module` follows the
    `Backend` protocol (`kernels/protocol.py`): `token_logprobs_fwd` / `token_logprobs_bwd`; `epilogue_module` adds
    `grpo_loss_fwd` (a token-level loss formed in the forward kernel's epilogue), `tile_module` the lean fused
    lm_head's `TileStats` / `tile_grad_`."""

    name: str
    module: str
    dtypes: tuple[torch.dtype, ...]  # of the logits / hidden states it computes on
    usable: Callable[[torch.device], tuple[bool, str]] = _always  # (ok, why not) on a device
    stats: bool = False  # the extra per-token statistics (`function.TOKEN_STATS`)
    contiguous_vocab: bool = False  # reads logits with stride 1 along V (others are copied first)
    epilogue_module: str | None = None
    epilogue_kl: tuple[str, ...] = ()  # the KL estimators its epilogue implements
    epilogue_needs_grad: bool = False  # its epilogue pays only when a gradient is taken (else the two-phase route)
    tile_module: str | None = None
    before_import: Callable[[], None] | None = None  # a check to run before its modules are imported


def _check_triton() -> None:
    check_triton_version()


HALF_AND_SINGLE = (torch.bfloat16, torch.float16, torch.float32)
CAPABILITIES = {
    "torch": Capabilities(
        name="torch",
        module="grpo_kernels.kernels.token_logprobs_torch",
        dtypes=(*HALF_AND_SINGLE, torch.float64),
        stats=True,
        epilogue_module="grpo_kernels.kernels.grpo_loss_torch",
        epilogue_kl=("k1", "k2", "k3", "low_var_kl"),
        epilogue_needs_grad=True,  # ops, not kernels: dL/dlogp saves the algebra's autograd graph, nothing more
        tile_module="grpo_kernels.kernels.lean_torch",
    ),
    "triton": Capabilities(
        name="triton",
        module="grpo_kernels.kernels.token_logprobs_triton",
        dtypes=HALF_AND_SINGLE,
        usable=lambda device: triton_usable(device),
        stats=True,
        contiguous_vocab=True,
        epilogue_module="grpo_kernels.kernels.grpo_loss_triton",
        epilogue_kl=("k1", "k2", "k3", "low_var_kl"),
        tile_module="grpo_kernels.kernels.lean_triton",
        before_import=_check_triton,  # a clear error for an unsupported triton, before triton is imported
    ),
    "cuda": Capabilities(
        name="cuda",
        module="grpo_kernels.kernels.cuda",
        dtypes=HALF_AND_SINGLE,
        usable=lambda device: cuda.cuda_usable(device),
        contiguous_vocab=True,
        epilogue_module="grpo_kernels.kernels.cuda",
        epilogue_kl=("k1", "k2", "k3", "low_var_kl"),
    ),
}


BACKENDS = ("auto", *CAPABILITIES)
_loaded: dict[tuple[str, str], object] = {}


def kernels_of(backend: str, part: str = "module"):
    """The module of `backend` holding `part` ("module", "epilogue_module" or "tile_module" of its record),
    imported on first use: nothing runs at import."""
    module = _loaded.get((backend, part))
    if module is None:
        caps = CAPABILITIES[backend]
        name = getattr(caps, part)
        if name is None:
            raise ValueError(f"backend {backend!r} has no {part.replace('_module', '')} kernels")
        if caps.before_import is not None:
            caps.before_import()
        module = _loaded[(backend, part)] = importlib.import_module(name)
    return module


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn the user's `backend` into a concrete one, or raise a clear error; never falls back silently."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    ok, why = CAPABILITIES[backend].usable(device)
    if not ok:
        raise RuntimeError(why)
    return backend


def _version(text: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise RuntimeError(f"cannot read the triton version {text!r}")
    return tuple(int(part or 0) for part in match.groups())


@functools.cache
def check_triton_version(version: str | None = None) -> None:
    """RuntimeError if the installed triton (or `version`) is older than `TRITON_OLDEST`; a warning, once, if it is
    newer than `TRITON_NEWEST_SEEN`. Reads the package metadata: triton itself is not imported here."""
    if version is None:
        try:
            version = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:  # a build under another distribution name
            import triton

            version = triton.__version__
    found, oldest = _version(version), ".".join(map(str, TRITON_OLDEST))
    newest = ".".join(map(str, TRITON_NEWEST_SEEN))
    if found < TRITON_OLDEST:
        raise RuntimeError(
            f"backend='triton' needs triton >= {oldest} (the one torch 2.10 and 2.11 pin), got triton {version}; "
            f"pip install 'triton>={oldest},<3.10', or use backend='torch'"
        )
    if found[:2] > TRITON_NEWEST_SEEN:
        warnings.warn(
            f"triton {version} is newer than the newest this release was checked with ({newest}); its kernels pin "
            "enable_fp_fusion=True, but nothing else about them was checked on it",
            stacklevel=2,
        )

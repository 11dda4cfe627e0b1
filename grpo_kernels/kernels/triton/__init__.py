"""The Triton backend: the kernels and their launchers (`token_logprobs.py`, the fused loss epilogue `grpo_loss.py`),
the launches as torch.library custom ops with fakes, which the drivers call (`ops.py`), the lean fused lm_head's
tiles (`lean.py`), and its record. Importing this package never imports triton: its record
checks the installed version first (`check_triton_version`, from the package metadata)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import warnings

import torch

from grpo_kernels.kernels.protocol import EPILOGUE_KL, HALF_AND_SINGLE, Capabilities

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


def _check_triton() -> None:
    check_triton_version()


RECORD = Capabilities(
    name="triton",
    module="grpo_kernels.kernels.triton.ops",
    dtypes=HALF_AND_SINGLE,
    usable=triton_usable,
    stats=True,
    contiguous_vocab=True,
    epilogue_module="grpo_kernels.kernels.triton.ops",
    epilogue_kl=EPILOGUE_KL,
    tile_module="grpo_kernels.kernels.triton.lean",
    before_import=_check_triton,  # a clear error for an unsupported triton, before triton is imported
)

"""The backends: their capability records gathered (each declared in its subpackage: `torch/`, `triton/`, `cuda/`),
"auto" resolution, the modules of a backend imported on first use, and a launch counter (tests read it to prove
which backend ran). `kernels/README.md` says how to add one."""

from __future__ import annotations

import importlib
import sys
from collections import Counter

import torch

from grpo_kernels.kernels import cuda
from grpo_kernels.kernels import torch as torch_backend
from grpo_kernels.kernels import triton as triton_backend
from grpo_kernels.kernels.protocol import Capabilities

launches: Counter[str] = Counter()  # backend name (and "fused_epilogue") -> vocabulary passes launched
check_triton_version = triton_backend.check_triton_version  # the supported triton range (`kernels/triton`)
TRITON_OLDEST, TRITON_NEWEST_SEEN = triton_backend.TRITON_OLDEST, triton_backend.TRITON_NEWEST_SEEN
CAPABILITIES: dict[str, Capabilities] = {r.name: r for r in (torch_backend.RECORD, triton_backend.RECORD, cuda.RECORD)}


BACKENDS = ("auto", *CAPABILITIES)


def count_launch(name: str, passes: int = 1) -> None:
    """Count `passes` launches of `name` in `launches`; not while torch.compile traces, where the count would be a
    side effect of the traced call that its graph does not hold."""
    if not torch.compiler.is_compiling():
        launches[name] += passes


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
        module = sys.modules[_import(backend, name)]
        if not torch.compiler.is_compiling():  # a write the compiler cannot hold inside an autograd Function
            _loaded[(backend, part)] = module
    return module


def constant_under_compile(fn):
    """`torch.compiler.assume_constant_result(fn)`, without its import of torch._dynamo (which imports triton, and
    the package imports nothing heavy): the mark that decorator sets, which torch.compile reads while tracing."""
    fn._dynamo_marked_constant = True
    return fn


@constant_under_compile
def _import(backend: str, name: str) -> str:
    """Import the backend's module `name` (after the record's `before_import`) and return its name; torch.compile
    runs the import while tracing instead of breaking the graph on it."""
    caps = CAPABILITIES[backend]
    if caps.before_import is not None:
        caps.before_import()
    importlib.import_module(name)
    return name


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


def launch(name: str, part: str = "module", passes: int = 1, also: str | None = None):
    """The module of backend `name` holding `part` (`kernels_of`), its `passes` launches counted (and one of `also`,
    a route's own count): what a driver calls once per pass."""
    if passes:
        count_launch(name, passes)
    if also is not None:
        count_launch(also)
    return kernels_of(name, part)

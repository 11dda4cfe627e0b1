"""The fused lm_head's memory policy, decided by the engine and handed to the kernels as plain data
(`PassOptions.memory`, `.chunk_size`): the rows per chunk of "fast" memory, what memory="auto" resolves to, and
the backends with a lean tile pass."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from grpo_kernels.kernels import fused_linear
from grpo_kernels.kernels.backend import CAPABILITIES, constant_under_compile

CPU_CHUNK_ROWS = 512
CPU_CHUNK_BYTES = 1 << 28  # at most 256 MiB of logits per chunk


def chunk_rows(
    num_rows: int, vocab: int, hidden: int, device: torch.device, chunk_size: int | None, dtype, replay: bool = False
) -> int:
    """Rows per chunk: `chunk_size`, else what a chunk's logits [rows, V] and hidden rows [rows, H] in `dtype`
    (plus their float32 copies where `gemm_mode` upcasts; on CUDA with sampling `replay` two float32 scratch
    chunks) take of a memory budget (CUDA: a quarter of free memory, at most 1 GiB, and 1 GiB inside a graph
    capture; CPU: 256 MiB and at most 512 rows, a budget for the GEMMs' speed rather than for memory), at least 1
    and at most `num_rows`."""
    if chunk_size is not None:
        return max(1, min(chunk_size, num_rows))
    itemsize = dtype.itemsize
    if fused_linear.gemm_mode(device) == "upcast" and itemsize < 4:
        itemsize += 4
    row_bytes = itemsize * (vocab + hidden) + (8 * vocab if replay and device.type == "cuda" else 0)
    if device.type == "cuda":  # inside a CUDA graph capture the free memory is not asked: the 1 GiB cap
        free = 1 << 32 if torch.cuda.is_current_stream_capturing() else torch.cuda.mem_get_info(device)[0]
        rows = min(free // 4, 1 << 30) // row_bytes
    else:
        rows = min(CPU_CHUNK_BYTES // row_bytes, CPU_CHUNK_ROWS)
    return max(1, min(rows, num_rows))


def available_bytes(device: torch.device) -> int | None:
    """Free memory of the device (CPU: available physical pages); None inside a CUDA graph capture (not asked)."""
    if device.type == "cuda":
        return None if torch.cuda.is_current_stream_capturing() else torch.cuda.mem_get_info(device)[0]
    return _host_available_bytes()


@constant_under_compile
def _host_available_bytes() -> int:
    """The host's available physical memory; torch.compile reads it once while tracing (a call it cannot trace)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_memory(memory: str, backend: str, rows: int, weight: Tensor, chunk_size: int | None, tile=None) -> str:
    """The mode, "fast" or "lean", of `memory`. "auto" is "lean" when `tile` is given, "fast" when `chunk_size`
    is; else "lean" when what "fast" adds beyond the gradients would not fit in half the free memory (CPU: the
    available physical memory): its float32 dW accumulator [V, H] (plus the cast to bf16/fp16 weights) and one
    chunk of logits [chunk rows, V]. "fast" inside a CUDA graph capture (free memory is not asked there) and on the
    "cuda" backend (no tile pass)."""
    if memory != "auto":
        return memory
    if tile is not None:
        return "lean"
    free = available_bytes(weight.device)
    if chunk_size is not None or CAPABILITIES[backend].tile_module is None or free is None:
        return "fast"
    V, H = weight.shape
    dtype = weight.dtype
    chunk = chunk_rows(rows, V, H, weight.device, None, dtype) * V * dtype.itemsize
    dw = V * H * (4 + (dtype.itemsize if dtype.itemsize < 4 else 0))
    return "fast" if dw + chunk <= free // 2 else "lean"


def lean_backends() -> tuple[str, ...]:
    """The backends with a tile pass (`Capabilities.tile_module`)."""
    return tuple(name for name, caps in CAPABILITIES.items() if caps.tile_module is not None)

"""One route for every rank: under a process group, `memory="auto"` of the fused lm_head is resolved once per call
into "fast" or "lean" with the same answer on every rank. Each rank's own choice depends on its rows and its free
memory, and the routes make different collectives under ZeRO-3 (lean gathers the weight again in its backward, the
3-GEMM route does not), so ranks that chose apart would wait for each other forever. One small all-reduce (the
maximum: "lean" where any rank needs it) settles it; a single process keeps its own choice."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.engine.memory import resolve_memory
from grpo_kernels.kernels.backend import resolve_backend


def agreed_memory(weight: Tensor, mask: Tensor, backend: str = "auto") -> str:
    """The memory mode, "fast" or "lean", of a fused lm_head call over the kept rows of `mask` with `weight`
    [V, H]: this rank's `memory="auto"` choice, made the same on every rank of the default process group."""
    rows = int(mask.sum())
    choice = resolve_memory("auto", resolve_backend(backend, weight.device), rows, weight, None)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return choice
    device = weight.device if dist.get_backend() == "nccl" else torch.device("cpu")
    lean = torch.tensor([1.0 if choice == "lean" else 0.0], device=device)
    dist.all_reduce(lean, op=dist.ReduceOp.MAX)
    return "lean" if lean.item() > 0 else "fast"

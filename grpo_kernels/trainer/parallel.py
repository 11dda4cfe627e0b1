"""Data parallelism for the trainer: `torchrun --nproc_per_node=K -m grpo_kernels.train ...`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; `init_parallel` then joins the process group (NCCL on CUDA, gloo on
CPU) and picks this rank's device. Every rank draws the same prompts and keeps its own contiguous share of them
(`local_rows`), generates and scores its completions, and all-gathers the rewards (`gather_rows`) so group and
batch statistics (advantages) are those of the global batch. `wrap_policy` puts the policy module under DDP
(`parallel: ddp`, the default with K > 1) or FSDP2 (`parallel: fsdp`: every decoder layer and the root sharded
with `fully_shard`). The token-count normalisers are all-reduced by `grpo_kernels.distributed`, so K processes
compute the same update as one.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grpo_kernels.shown import shown

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")


@dataclass(frozen=True)
class ParallelState:
    """This process's place among the K data-parallel ranks (K = 1 without torchrun)."""

    rank: int
    world_size: int
    device: torch.device
    mode: str  # "none", "ddp" or "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_parallel(mode: str, device: str) -> ParallelState:
    """Join torchrun's process group when WORLD_SIZE > 1 (once per process); resolve `mode` and the device."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {shown(mode)}")
    check_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if world_size == 1:
        if mode == "fsdp":
            raise ValueError("parallel='fsdp' needs several processes: launch with torchrun --nproc_per_node=K")
        return ParallelState(0, 1, _device(device, cuda, 0), "none")
    if mode == "none":
        raise ValueError(f"parallel='none' with WORLD_SIZE={world_size}: use 'ddp' or 'fsdp' under torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local_rank)
    return ParallelState(dist.get_rank(), dist.get_world_size(), _device(device, cuda, local_rank), _mode(mode))


def check_device(device: str) -> None:
    """A ValueError for a device that torch does not know, or that this machine or this torch build cannot use."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {shown(device)}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build, but no GPU is visible"
        raise ValueError(
            f"device {shown(device)}: CUDA is not available (torch {torch.__version__} is {build}); use cpu or auto"
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {shown(device)}: this machine has {torch.cuda.device_count()} GPU(s)")


def _mode(mode: str) -> str:
    return "ddp" if mode == "auto" else mode


def _device(name: str, cuda: bool, local_rank: int) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    return torch.device(name)


def local_rows(total: int, state: ParallelState) -> slice:
    """This rank's contiguous share of `total` items; `total` must split evenly over the ranks."""
    if total % state.world_size:
        raise ValueError(f"{total} prompts per step do not split evenly over {state.world_size} ranks")
    share = total // state.world_size
    return slice(state.rank * share, (state.rank + 1) * share)


def gather_rows(x: Tensor, state: ParallelState) -> Tensor:
    """Concatenation over ranks (in rank order) of each rank's equally sized `x` [b, ...] -> [K·b, ...]."""
    if state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def mean_over_ranks(values: dict[str, float], state: ParallelState) -> dict[str, float]:
    """Each metric averaged over the ranks (every rank gets the same numbers)."""
    if state.world_size == 1 or not values:
        return values
    names = sorted(values)
    stacked = torch.tensor([values[n] for n in names], dtype=torch.float64, device=state.device)
    dist.all_reduce(stacked)
    return dict(zip(names, (stacked / state.world_size).tolist(), strict=True))


def wrap_policy(module: nn.Module, state: ParallelState) -> nn.Module:
    """`module` (a `PolicyModule`) under DDP or FSDP2, or itself for one process."""
    if state.mode == "none":
        return module
    if state.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [state.device.index] if state.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in module.model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(module)
    for method in ("logprobs", "generate"):  # parameters gathered for these as for forward
        register_fsdp_forward_method(module, method)
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """The `PolicyModule` inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return getattr(module, "module", module)


def no_gradient_sync(module: nn.Module, sync: bool) -> AbstractContextManager:
    """Context for one micro-batch's backward: gradients are reduced across ranks only when `sync` (the last)."""
    if sync:
        return nullcontext()
    if hasattr(module, "no_sync"):  # DDP
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        return _FSDPNoSync(module)
    return nullcontext()


class _FSDPNoSync(AbstractContextManager):
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc) -> None:
        self.module.set_requires_gradient_sync(True)

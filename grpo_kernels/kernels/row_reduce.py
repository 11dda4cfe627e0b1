"""How per-row values of the logits combine when a row is split over the ranks of a vocabulary shard's group: the
max, the sum and the k largest (sampling replay's thresholds and the shards' merge)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class RowReduce:
    """How per-row values combine over the pieces of a row: one process holds it whole (`group` None), or each rank
    of a vocabulary shard's `group` holds columns of it; `vocab` is the whole row's length."""

    vocab: int
    group: Any = None

    def max(self, x: Tensor) -> Tensor:
        return x if self.group is None else all_reduce(x.contiguous(), self.group, dist.ReduceOp.MAX)

    def sum(self, x: Tensor) -> Tensor:
        return x if self.group is None else all_reduce(x.contiguous(), self.group)

    def top(self, z: Tensor, k: int) -> Tensor:
        """The k largest values of each row [C, k], descending; on shards from every shard's own k largest (one
        all-gather of R·k values per row)."""
        local = z.topk(min(k, z.shape[-1]), dim=-1).values  # [C, ≤k]
        if self.group is None:
            return local
        local = torch.nn.functional.pad(local, (0, k - local.shape[-1]), value=-math.inf).contiguous()  # [C, k]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1).topk(k, dim=-1).values  # [C, k]


def all_reduce(x: Tensor, group: Any, op=dist.ReduceOp.SUM) -> Tensor:
    """x reduced over `group` in place (`op`: SUM unless given), returned."""
    dist.all_reduce(x, op=op, group=group)
    return x

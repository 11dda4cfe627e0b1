"""Sums over each sequence's tokens and over the batch, across the ranks the sequences are split over.

Context parallel: every rank of `group` holds some tokens of the same B sequences (a padded `[B, T_r]` view, or the
packed layout's `[S, T_max]`), and per-sequence values alike. A sequence-level variant needs each sequence's sum over
all its tokens (GSPO's mean log-ratio, VESPO's and TIC-GRPO's summed log-ratios, GMPO's means, the token counts of
the normalisers): one all-reduce of O(B) values each. The all-reduce is differentiable: each rank's loss uses the
global sums, so the gradient of the ranks' summed loss w.r.t. one rank's part is the gradient summed over ranks.
Without a group (None) every function is the plain local sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed_nn
from torch import Tensor


def all_reduce_sum(x: Tensor, group: Any) -> Tensor:
    """x summed over the ranks of `group` (x itself when None); differentiable: torch's own collective, whose
    backward sums the incoming gradients over the ranks as well."""
    return x if group is None else distributed_nn.all_reduce(x, group=group)


def sequence_sum(x: Tensor, mask: Tensor, group: Any) -> Tensor:
    """Σ over each sequence's kept tokens on every rank of x [B, T] (mask [B, T]), [B, 1]; one all-reduce."""
    return all_reduce_sum((x * mask).sum(-1, keepdim=True), group)


def sequence_mean(x: Tensor, mask: Tensor, group: Any) -> Tensor:
    """Mean over each sequence's kept tokens (0 for none), [B, 1]; one all-reduce of the sums and counts."""
    sums = all_reduce_sum(
        torch.cat([(x * mask).sum(-1, keepdim=True), mask.sum(-1, keepdim=True).to(x.dtype)], 1), group
    )
    return sums[:, :1] / sums[:, 1:].clamp(min=1.0)  # [B, 1]


def sequence_tokens(mask: Tensor, group: Any) -> Tensor:
    """Each sequence's kept tokens over all ranks, [B, 1]."""
    return all_reduce_sum(mask.sum(-1, keepdim=True), group)


def batch_sum(x: Tensor, group: Any) -> Tensor:
    """x.sum() over every rank (0-dim); differentiable."""
    return all_reduce_sum(x.sum(), group)


def gather_kept(values: Tensor, group: Any) -> Tensor:
    """The 1-D `values` of every rank, concatenated (rank order): an all-gather of the counts, then of the values
    padded to the largest count. Not differentiable (`top_entropy_quantile`'s threshold)."""
    if group is None:
        return values
    world = dist.get_world_size(group)
    count = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = values.new_zeros(max(sizes))
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

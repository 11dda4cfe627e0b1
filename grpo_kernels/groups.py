"""Group bookkeeping of the per-sequence building blocks: dense group indices and per-group statistics.

Sequences with equal group ids form a group; groups may have any sizes, sit anywhere in the batch and carry any
integer ids (rewards also take hashable ids, e.g. verl's `uid` strings). Everything works on the dense index
[B] of `group_index`: statistics are scatter reductions along dim 0 of values [B] or [B, ...], with no Python loop
over groups, and come back broadcast to every member (take `x[group_first(index)]` for one value per group).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import check_length, check_shape, is_integer


def group_index(group_ids: Tensor | Sequence[Hashable], size: int) -> Tensor:
    """Dense group index [B] in 0..G−1 of B = `size` group ids.

    An integer tensor [B] is numbered in ascending id order (group g holds the g-th smallest id); a sequence of
    hashable ids is numbered by first appearance and the index lives on the CPU. A tensor of another dtype is a
    ValueError here (the argument may be any sequence); tensor-only callers reject it first with `check_ids`.
    """
    if not isinstance(group_ids, Tensor):
        check_length("group_ids", group_ids, size)
        first: dict[Hashable, int] = {}
        return torch.tensor([first.setdefault(key, len(first)) for key in group_ids], dtype=torch.long)  # [B]
    if not is_integer(group_ids):
        raise ValueError(f"group_ids must be an integer tensor or a sequence of hashable ids, got {group_ids.dtype}")
    check_shape("group_ids", group_ids, (size,))
    return torch.unique(group_ids, return_inverse=True)[1]  # [B]


def subgroup_index(index: Tensor, keys: Tensor) -> Tensor:
    """Dense index [B] of each member's (group, key) pair: every group split by the integer (or bool) `keys` [B]."""
    return torch.unique(torch.stack([index, keys.to(index.dtype)], dim=1), dim=0, return_inverse=True)[1]  # [B]


def group_first(index: Tensor) -> Tensor:
    """Batch position [G] of each group's first member, group by group."""
    positions = torch.arange(len(index), device=index.device)  # [B]
    num_groups = int(index.max()) + 1 if len(index) else 0
    return positions.new_full((num_groups,), len(index)).scatter_reduce_(0, index, positions, "amin")  # [G]


def group_members(index: Tensor) -> Tensor:
    """Batch positions [G, S] of each group's members in batch order, padded with −1 (S: the largest group)."""
    position = group_rank(torch.arange(len(index), device=index.device), index)  # [B] place inside the group
    num_groups, width = (int(index.max()) + 1, int(position.max()) + 1) if len(index) else (0, 0)
    members = index.new_full((num_groups, width), -1)  # [G, S]
    members[index, position] = torch.arange(len(index), device=index.device)
    return members


def group_sum(values: Tensor, index: Tensor) -> Tensor:
    """Sum of `values` [B] or [B, ...] over each member's group, broadcast back: [B] or [B, ...]."""
    return values.new_zeros(values.shape).index_add_(0, index, values)[index]  # rows >= G stay unused


def group_size(index: Tensor) -> Tensor:
    """Number of members [B] (int64) of each member's group."""
    return group_sum(torch.ones_like(index), index)  # [B]


def group_mean(values: Tensor, index: Tensor) -> Tensor:
    """Mean of `values` [B] or [B, ...] over each member's group, broadcast back."""
    return group_sum(values, index) / group_size(index).view(-1, *[1] * (values.ndim - 1))  # [B, ...]


def _group_extreme(values: Tensor, index: Tensor, reduce: str) -> Tensor:
    scatter_index = index.view(-1, *[1] * (values.ndim - 1)).expand_as(values)  # [B, ...]
    extreme = values.new_zeros(values.shape).scatter_reduce_(0, scatter_index, values, reduce, include_self=False)
    return extreme[index]  # [B, ...]


def group_min(values: Tensor, index: Tensor) -> Tensor:
    """Minimum of `values` [B] or [B, ...] over each member's group, broadcast back."""
    return _group_extreme(values, index, "amin")


def group_max(values: Tensor, index: Tensor) -> Tensor:
    """Maximum of `values` [B] or [B, ...] over each member's group, broadcast back."""
    return _group_extreme(values, index, "amax")


def group_varies(values: Tensor, index: Tensor) -> Tensor:
    """Whether the values [B] of each member's group are not all equal (tested exactly, as max > min): bool [B]."""
    return group_max(values, index) > group_min(values, index)  # [B]


def group_deviation(values: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(size, x − mean, unbiased std) of each element's group, each shaped like `values` ([B] or [B, ...]).

    The mean is taken after shifting each group by its minimum, so a group of equal values (all right, all wrong,
    a group of one) has deviation and std exactly 0, with no rounding residue for a small `eps` to amplify.
    A group of one has std 0 (not NaN).
    """
    shifted = values - group_min(values, index)  # [B, ...]
    size = group_sum(torch.ones_like(values), index)  # [B, ...]
    deviation = shifted - group_sum(shifted, index) / size  # [B, ...]
    std = (group_sum(deviation**2, index) / (size - 1).clamp(min=1)).sqrt()  # [B, ...]
    return size, deviation, std


def group_zscore(values: Tensor, index: Tensor, eps: float) -> Tensor:
    """(x − mean_G)/(std_G + eps) with the unbiased std; a zero-variance group gets exactly 0 (also for eps = 0)."""
    _, deviation, std = group_deviation(values, index)
    return torch.where(std > 0, deviation / (std + eps), 0.0)  # [B, ...]


def group_rank(values: Tensor, index: Tensor) -> Tensor:
    """0-based ascending rank [B] of each value of `values` [B] within its group; ties keep batch order."""
    by_value = torch.argsort(values, stable=True)  # [B]
    order = by_value[torch.argsort(index[by_value], stable=True)]  # [B] sorted by (group, value, position)
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order), device=order.device)  # [B] position in that order
    sizes = torch.bincount(index)  # [G]
    starts = torch.cumsum(sizes, 0) - sizes  # [G] first position of each group
    return position - starts[index]  # [B]

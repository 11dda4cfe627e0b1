"""Global normalisers for gradient accumulation × data parallel.

A token-mean loss over an optimizer step's whole batch, split over K ranks and M accumulation micro-batches, is
Σ_ranks Σ_micro Σ_tokens L / N_global. Data-parallel training averages gradients over the K ranks and
accumulation sums them over micro-batches, so each micro-batch's loss must be its own token sum divided by

    num_items_in_batch = N_global / K,   N_global = Σ over ranks and micro-batches of mask.sum()

which is what `num_items_in_batch(masks)` returns (pass every micro-batch mask of the step on this rank). The
same holds for sequence counts (`num_sequences_in_batch`, the seq-mean loss_agg_modes). If your loop also divides
each micro-batch loss by M itself (as the Hugging Face Trainer does), multiply the value by M.
Without an initialised torch.distributed process group, K = 1 and nothing is reduced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce_sum(x: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _as_list(masks: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [masks] if isinstance(masks, Tensor) else list(masks)


def global_token_count(masks: Tensor | Sequence[Tensor]) -> Tensor:
    """N_global: kept tokens in these micro-batch masks, summed over all ranks (0-dim float64)."""
    local = sum(m.to(torch.float64).sum() for m in _as_list(masks))
    return _all_reduce_sum(torch.as_tensor(local, dtype=torch.float64).clone())


def global_sequence_count(masks: Tensor | Sequence[Tensor]) -> Tensor:
    """Sequences with at least one kept token in these [B, T] masks, summed over all ranks (0-dim float64)."""
    local = sum((m.sum(-1) > 0).to(torch.float64).sum() for m in _as_list(masks))
    return _all_reduce_sum(torch.as_tensor(local, dtype=torch.float64).clone())


def num_items_in_batch(masks: Tensor | Sequence[Tensor]) -> Tensor:
    """N_global / K: the `num_items_in_batch` that makes K ranks × M micro-batches compute one batch's update."""
    return global_token_count(masks) / _world_size()


def num_sequences_in_batch(masks: Tensor | Sequence[Tensor]) -> Tensor:
    """S_global / K: the `num_sequences_in_batch` of the seq-mean loss_agg_modes under data parallelism."""
    return global_sequence_count(masks) / _world_size()

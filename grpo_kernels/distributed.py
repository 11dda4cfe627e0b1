"""Global normalisers for gradient accumulation × data parallel.

A token-mean loss over an optimizer step's whole batch, split over K ranks and M accumulation micro-batches, is
Σ_ranks Σ_micro Σ_tokens L / N_global. Data-parallel training averages gradients over the K ranks and
accumulation sums them over micro-batches, so each micro-batch's loss must be its own token sum divided by

    num_items_in_batch = N_global / K,   N_global = Σ over ranks and micro-batches of mask.sum()

which is what `num_items_in_batch(masks)` returns (pass every micro-batch mask of the step on this rank). The
same holds for sequence counts (`num_sequences_in_batch`, the seq-mean loss_agg_modes). If your loop also divides
each micro-batch loss by M itself (as the Hugging Face Trainer does), multiply the value by M.
Without an initialised torch.distributed process group, K = 1 and nothing is reduced.

The other two splits are arguments of the loss functions: `process_group=` (a vocabulary-sharded lm_head or logits,
tensor parallel: `kernels.parallel`) and `sequence_group=` (sequences split across ranks, context parallel:
`losses.reduce`). Both give every rank the numbers of one process on the whole vocabulary / the whole sequences.
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


_PER_RANK_SCALE = ("item_mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # Z from num_*_in_batch
_ROW_SCALE = ("sequence_mean", "constant_length", "sequence_sum_mean")  # Z ∝ the batch's rows B
_TOKEN_SCALE = ("token_mean",)  # Z = the batch's kept tokens
_NO_SCALE = ("token-sum", "seq-mean-token-sum-norm")  # Z independent of the batch


def micro_batch_scale(normaliser: str, micro_mask: Tensor, step_masks: Sequence[Tensor]) -> Tensor:
    """The factor a micro-batch's loss is multiplied by so that K ranks × M micro-batches (gradients summed over
    micro-batches, averaged over ranks) make one process's update on the whole step batch.

    `normaliser` is the loss's (`options.loss_agg_mode` or its loss type's, `aggregate.NORMALISERS`), `micro_mask`
    [b, T] this micro-batch's, `step_masks` every micro-batch mask of the step on this rank. With Z the normaliser
    of the whole step batch and z the micro-batch's, the factor is K · z / Z: 1 for the `num_items_in_batch` /
    `num_sequences_in_batch` normalisers (already global, pass those), K · b / B_global for the per-row ones
    (grpo, dr_grpo, luspo), K · n / N_global for BNPO's token mean, K for the batch-independent sums.
    """
    if normaliser in _PER_RANK_SCALE:
        return torch.ones((), dtype=torch.float64)
    world = _world_size()
    if normaliser in _ROW_SCALE:
        rows = torch.tensor(float(sum(m.shape[0] for m in step_masks)), dtype=torch.float64, device=micro_mask.device)
        return world * micro_mask.shape[0] / _all_reduce_sum(rows).cpu()
    if normaliser in _TOKEN_SCALE:
        tokens = global_token_count(step_masks).clamp(min=1.0)
        return world * micro_mask.to(torch.float64).sum().clamp(min=1.0).cpu() / tokens.cpu()  # 0-dim
    if normaliser in _NO_SCALE:
        return torch.full((), float(world), dtype=torch.float64)
    raise ValueError(f"unknown normaliser {normaliser!r}")

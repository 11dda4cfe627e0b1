"""Normalisers: how a loss type turns masked per-token losses [B, T] (or [B, 1]) into one scalar."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_kernels.options import LossOptions

Normaliser = Callable[[Tensor, Tensor, LossOptions], Tensor]


def sequence_mean(loss: Tensor, mask: Tensor, options: LossOptions) -> Tensor:
    """Mean over sequences of each sequence's masked token mean (GRPO, SAPO)."""
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def token_mean(loss: Tensor, mask: Tensor, options: LossOptions) -> Tensor:
    """Masked mean over all tokens of this batch (BNPO)."""
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def item_mean(loss: Tensor, mask: Tensor, options: LossOptions) -> Tensor:
    """Masked token sum over `num_items_in_batch` (the global token count; this batch's when None) (DAPO)."""
    items = mask.sum() if options.num_items_in_batch is None else torch.as_tensor(options.num_items_in_batch)
    return (loss * mask).sum() / items.to(loss.device, loss.dtype).clamp(min=1.0)


def constant_length(loss: Tensor, mask: Tensor, options: LossOptions) -> Tensor:
    """Masked token sum over B · max_completion_length, a batch-independent constant (Dr.GRPO)."""
    return (loss * mask).sum() / (mask.shape[0] * options.max_completion_length)


def sequence_sum_mean(loss: Tensor, mask: Tensor, options: LossOptions) -> Tensor:
    """Mean over sequences of each sequence's masked token sum (LUSPO)."""
    return (loss * mask).sum(-1).mean()


NORMALISERS: dict[str, Normaliser] = {
    "sequence_mean": sequence_mean,
    "token_mean": token_mean,
    "item_mean": item_mean,
    "constant_length": constant_length,
    "sequence_sum_mean": sequence_sum_mean,
}

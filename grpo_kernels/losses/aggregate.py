"""Normalisers as per-token weights: every loss type reduces as Σ_{b,t} ω[b, t] · L[b, t], ω = m / Z.

One template for every mode: a normaliser only says what Z is for each token. The same weights are what the fused
kernel epilogue multiplies into each token's loss and gradient. With sequences split across the ranks of `group`
(`losses.reduce`), the token counts in Z are those of whole sequences and of the whole batch, over every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.losses.reduce import batch_sum, sequence_tokens
from grpo_kernels.options import LossOptions

Normaliser = Callable[[Tensor, LossOptions, Any], Tensor]


def sequence_mean(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = B · |o_b|: each sequence's token mean, then the mean over sequences (GRPO, SAPO)."""
    return mask / (mask.shape[0] * sequence_tokens(mask, group).clamp(min=1.0))  # [B, T]


def token_mean(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = Σ m: the mean over this batch's tokens (BNPO)."""
    return mask / batch_sum(mask, group).clamp(min=1.0)  # [B, T]


def item_mean(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = `num_items_in_batch` (the global token count; this batch's, at least 1, when None) (DAPO, CISPO, VESPO).

    A given value is used as it is, a fraction in (0, 1) included: TRL clamps its token count at 1 and then
    rescales it (÷ processes · accumulation ÷ steps_per_generation), which can fall below 1, and divides by that."""
    if options.num_items_in_batch is None:
        return mask / batch_sum(mask, group).to(mask.dtype).clamp(min=1.0)  # [B, T]
    z = torch.as_tensor(options.num_items_in_batch, dtype=mask.dtype, device=mask.device)  # a float: not via float32
    return mask / z  # [B, T]


def constant_length(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = B · max_completion_length, a batch-independent constant (Dr.GRPO)."""
    return mask / (mask.shape[0] * options.max_completion_length)  # [B, T]


def sequence_sum_mean(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = B: each sequence's token sum, then the mean over sequences (LUSPO)."""
    return mask / mask.shape[0]  # [B, T]


def _sequences(mask: Tensor, options: LossOptions, group: Any) -> Tensor:
    """`num_sequences_in_batch`, or this batch's count of sequences with at least one kept token, at least 1."""
    if options.num_sequences_in_batch is None:
        return (sequence_tokens(mask, group) > 0).sum().to(mask.dtype).clamp(min=1.0)
    return torch.as_tensor(options.num_sequences_in_batch).to(mask.device, mask.dtype).clamp(min=1.0)


def token_sum(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = 1: the plain masked token sum (verl `token-sum`)."""
    return mask  # [B, T]


def seq_mean_token_sum(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = S: token sums averaged over the S non-empty sequences (verl `seq-mean-token-sum`)."""
    return mask / _sequences(mask, options, group)  # [B, T]


def seq_mean_token_mean(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = S · |o_b|: token means averaged over the S non-empty sequences (verl `seq-mean-token-mean`)."""
    return mask / (sequence_tokens(mask, group).clamp(min=1.0) * _sequences(mask, options, group))  # [B, T]


def seq_mean_token_sum_norm(mask: Tensor, options: LossOptions, group: Any = None) -> Tensor:
    """Z = `loss_scale_factor` (default T): Dr.GRPO's constant normaliser (verl `seq-mean-token-sum-norm`). With
    sequences split across ranks, T (the whole batch's padded length) is no rank's: give `loss_scale_factor`."""
    if options.loss_scale_factor is None and group is not None:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' with a sequence_group needs loss_scale_factor")
    factor = mask.shape[-1] if options.loss_scale_factor is None else options.loss_scale_factor
    return mask / factor  # [B, T]


NORMALISERS: dict[str, Normaliser] = {
    "sequence_mean": sequence_mean,
    "token_mean": token_mean,
    "item_mean": item_mean,
    "constant_length": constant_length,
    "sequence_sum_mean": sequence_sum_mean,
    # verl's loss_agg_mode names, which override a loss type's own normaliser
    "token-mean": item_mean,
    "token-sum": token_sum,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def token_weights_for(mask: Tensor, normaliser: str, options: LossOptions, group: Any = None) -> Tensor:
    """ω [B, T] of the loss: `loss_agg_mode` when set, else the loss type's own `normaliser`; `group`: the ranks
    the sequences are split over."""
    return NORMALISERS[options.loss_agg_mode or normaliser](mask, options, group)

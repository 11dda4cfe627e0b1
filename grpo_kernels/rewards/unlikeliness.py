"""Unlikeliness reward ("Rewarding the Unlikely"): correct answers the policy found likely earn less."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import check_finite, check_shape, checked_floats
from grpo_kernels.groups import group_index, group_rank, group_size
from grpo_kernels.rewards import REWARDS


def _sequence_logp(old_logp: Tensor | Sequence[float], mask: Tensor | None) -> Tensor:
    """Per-sequence mean log-prob [B] from [B] (already reduced) or [B, T] with an optional [B, T] mask."""
    old_logp = old_logp if isinstance(old_logp, Tensor) else torch.as_tensor(old_logp, dtype=torch.float32)
    if old_logp.dim() == 1:
        return checked_floats("old_logp", old_logp, (len(old_logp),), dtype=torch.float32)
    if old_logp.dim() != 2:
        raise ValueError(f"old_logp must be [B] or [B, T], got {list(old_logp.shape)}")
    shape = tuple(old_logp.shape)
    keep = torch.ones_like(old_logp, dtype=torch.bool) if mask is None else check_shape("mask", mask, shape, "B, T")
    keep = keep.to(old_logp.device).bool()  # [B, T]
    values = torch.where(keep, old_logp.float(), 0.0)  # [B, T] padding never counts, even if NaN
    check_finite("old_logp", values)
    return values.sum(-1) / keep.sum(-1).clamp(min=1)  # [B]


@REWARDS.register("unlikeliness", paper="Rewarding the Unlikely, arXiv:2506.02355")
def unlikeliness(
    rewards: Tensor | Sequence[float],
    old_logp: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[Hashable],
    *,
    mask: Tensor | None = None,
    beta_rank: float = 0.25,
) -> Tensor:
    """r̃_i = r_i · (1 − β_rank · rank_i / G), rank_i = 0 for the group's least likely completion.

    Rewarding the Unlikely (He, Fried & Welleck, arXiv:2506.02355; spec §15), as in the official code
    (`ray_lean_trainer._compute_advantages`): within each group of size G, completions are ranked ascending by
    their masked mean token log-prob under π_old (`old_logp` [B, T] with `mask`, or the means [B] directly),
    ties in batch order, and the most likely correct answer is discounted most, countering GRPO's distribution
    sharpening. β_rank = 0.25 (release script). Wrong answers (r = 0) are unaffected. Returns [B] float32.
    """
    sequence_logp = _sequence_logp(old_logp, mask)  # [B]
    n = len(sequence_logp)
    rewards = checked_floats("rewards", rewards, (n,), dtype=torch.float32)
    sequence_logp = sequence_logp.to(rewards.device)
    index = group_index(group_ids, n).to(rewards.device)
    rank = group_rank(sequence_logp, index).float()  # [B]
    size = group_size(index)  # [B]
    return rewards * (1.0 - beta_rank * rank / size)  # [B]

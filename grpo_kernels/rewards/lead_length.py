"""GRPO-LEAD length-dependent reward: shorter correct answers earn more, wrong answers are penalised."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import checked_flags, checked_floats
from grpo_kernels.groups import group_index, group_sum
from grpo_kernels.rewards import REWARDS


@REWARDS.register("grpo_lead_length", paper="GRPO-LEAD, arXiv:2504.09696")
def grpo_lead_length(
    lengths: Tensor | Sequence[float],
    correct: Tensor | Sequence[bool],
    group_ids: Tensor | Sequence[Hashable],
    *,
    alpha: float = 0.05,
    incorrect_reward: float = -1.0,
) -> Tensor:
    """exp(−α·z_i) for a correct answer, z_i its length standardised over the group's correct answers; else −1.

    GRPO-LEAD (Zhang & Zuo, arXiv:2504.09696; spec §10): z_i = (|o_i| − mean_c |o|) / (std_c |o| + 1e-6),
    with mean_c and the unbiased std_c over the *correct* completions of i's group (std_c = 1 when fewer than
    two are correct, as in the official code). α = 0.05 (code). A wrong answer gets `incorrect_reward`, the
    paper's explicit penalty −1 (the released config defaults to 0). The code's gate (shape only when the three
    shortest completions average over 4000 tokens) is not part of the formula and is not applied.
    Returns [B] float32.
    """
    correct = checked_flags("correct", correct, (len(correct),))
    n = len(correct)
    lengths = checked_floats("lengths", lengths, (n,), dtype=torch.float64)
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    index = group_index(group_ids, n).to(lengths.device)
    hit = correct.to(lengths.device, torch.float64)  # [B]
    count = group_sum(hit, index)  # [B] correct answers in i's group
    mean = group_sum(lengths * hit, index) / count.clamp(min=1)  # [B]
    var = group_sum((lengths - mean) ** 2 * hit, index) / (count - 1).clamp(min=1)  # [B]
    std = torch.where(count >= 2, var.sqrt(), torch.ones_like(var))  # [B]
    z = (lengths - mean) / (std + 1e-6)  # [B]
    rewards = torch.where(hit.bool(), torch.exp(-alpha * z), torch.full_like(z, incorrect_reward))  # [B]
    return rewards.float()

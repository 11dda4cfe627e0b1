"""P-GRPO posterior composite reward: the thinking reward counts only when the outcome is correct."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import checked_flags, checked_floats
from grpo_kernels.rewards import REWARDS


@REWARDS.register("p_grpo_posterior", paper="Posterior-GRPO, arXiv:2508.05170")
def p_grpo_posterior(
    format_rewards: Tensor | Sequence[float],
    outcome_rewards: Tensor | Sequence[float],
    think_rewards: Tensor | Sequence[float],
) -> Tensor:
    """R_i = R_format + R_outcome + R_outcome · R_think: reasoning is rewarded only on a correct outcome.

    Posterior-GRPO (Fan et al., arXiv:2508.05170; spec §12, label *partial*): the process ("thinking") reward of
    a reasoning reward model is gated by the outcome, which stops the policy from hacking it with well-written
    reasoning that ends in failing code. The gate is verified from the paper; the additive form is the one of
    the community port (the paper's exact weighting of R_think was not retrieved). `format_rewards` is finite,
    `outcome_rewards` is 0/1 (tests passed), `think_rewards` ∈ [0, 1]. Returns [B] float32.
    """
    n = len(format_rewards)
    format_rewards = checked_floats("format_rewards", format_rewards, (n,), dtype=torch.float32)
    outcome = checked_flags("outcome_rewards", outcome_rewards, (n,)).to(format_rewards.device, format_rewards.dtype)
    think = checked_floats("think_rewards", think_rewards, (n,), dtype=torch.float32).to(format_rewards.device)
    if ((think < 0) | (think > 1)).any():
        raise ValueError(f"think_rewards must be in [0, 1], got {think.tolist()}")
    return format_rewards + outcome + outcome * think  # [B]

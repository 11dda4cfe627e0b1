"""SPO reasoning-trajectory-score reward: wrong answers earn partial credit for their correct reasoning prefix."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import checked_flags, checked_floats
from grpo_kernels.rewards import REWARDS


@REWARDS.register("spo_trajectory", paper="SPO / SGPO, arXiv:2505.11595")
def spo_trajectory(
    correct: Tensor | Sequence[bool], rts: Tensor | Sequence[float], *, beta: float = 5.0, gamma: float = 0.5
) -> Tensor:
    """1 for a correct answer, else σ(β·(RTS − γ)): the more of the reasoning is right, the higher the reward.

    SPO / SGPO (Chen et al., arXiv:2505.11595; spec §16, label *partial*): a step-wise judge marks the first
    error of each *incorrect* response; RTS ∈ [0, 1] is the fraction of the response (by length) before it.
    This gives all-wrong groups a reward spread, hence a gradient. The reward increases with RTS and stays
    below 1 (spec §26 item 6: grpo-composer's 1/(1 + exp(+β(RTS − γ))) decreases with RTS, the opposite of the
    paper's intent). β = 5, γ = 0.5 are the community constants (unverified). `rts` of correct answers is
    ignored but must still be in [0, 1]. Returns [B] float32.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0 so the reward increases with RTS (spec §26 item 6), got {beta}")
    correct = checked_flags("correct", correct, (len(correct),))
    rts = checked_floats("rts", rts, (len(correct),), dtype=torch.float32)
    if ((rts < 0) | (rts > 1)).any():
        raise ValueError(f"rts must be in [0, 1], got {rts.tolist()}")
    partial = torch.sigmoid(beta * (rts - gamma))  # [B]
    return torch.where(correct.to(rts.device), torch.ones_like(partial), partial)  # [B]

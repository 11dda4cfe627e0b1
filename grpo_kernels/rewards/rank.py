"""RankGRPO ranking reward (RLRR): a rule reward shaped by a listwise rank within the group."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import checked_flags, checked_floats
from grpo_kernels.groups import group_index, group_size
from grpo_kernels.rewards import REWARDS

RANK_MODES = ("weight", "supplement", "reward")


@REWARDS.register("rank_grpo", paper="RLRR (RankGRPO), arXiv:2601.23058")
def rank_grpo(
    rewards: Tensor | Sequence[float],
    ranks: Tensor | Sequence[int],
    group_ids: Tensor | Sequence[Hashable],
    *,
    mode: str = "weight",
    tau: float = 0.1,
) -> Tensor:
    """Rule reward s_i ∈ {0, 1} shaped by a listwise rank k_i ∈ {1..G} (1 = best) within its group.

    RLRR (Niu et al., arXiv:2601.23058; spec §14, label *partial*: the three modes are the community port's):
        weight:      s_i · exp(τ · (1 − k_i))
        supplement:  s_i + τ · tanh(G / k_i − 1)
        reward:      (G − k_i) / (G − 1)          (1 for a group of one)
    G is the size of i's group (groups may differ in size), τ = 0.1. `weight` and `supplement` (τ ≤ 1) keep
    every correct answer above every wrong one of its group; `reward` ignores correctness. Sign consistency of
    the *advantage* (spec §26 item 7) is the job of the `rank_grpo` advantage (advantages package), whose
    correctness-aware clip max(A, ξ⁻) / min(A, ξ⁺) defaults to ξ⁻ = ξ⁺ = 0. Returns [B] float32.
    """
    if mode not in RANK_MODES:
        raise ValueError(f"mode must be one of {RANK_MODES}, got {mode!r}")
    if not 0 <= tau <= (1 if mode == "supplement" else float("inf")):
        bound = "[0, 1] (a larger bonus lets a wrong answer outscore a right one)" if mode == "supplement" else ">= 0"
        raise ValueError(f"tau must be {bound} for mode={mode!r}, got {tau}")
    n = len(ranks)
    s = checked_flags("rewards", rewards, (n,)).float()
    k = checked_floats("ranks", ranks, (n,), dtype=torch.float32).to(s.device)
    size = group_size(group_index(group_ids, n).to(s.device))  # [B] G of i's group
    if (k != k.round()).any() or (k < 1).any() or (k > size).any():
        raise ValueError(f"ranks must be integers in 1..G (the size of the completion's group), got {k.tolist()}")
    if mode == "weight":
        return s * torch.exp(tau * (1 - k))  # [B]
    if mode == "supplement":
        return s + tau * torch.tanh(size / k - 1)  # [B]
    return torch.where(size > 1, (size - k) / (size - 1).clamp(min=1), torch.ones_like(k))  # [B]

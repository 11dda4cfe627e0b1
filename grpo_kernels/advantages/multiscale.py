"""MS-GRPO: relative advantages inside sampled subgroups at several scales, averaged over subgroups and scales."""

from __future__ import annotations

import math
from itertools import combinations

import torch
from torch import Tensor

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.checks import check_rewards
from grpo_kernels.groups import group_index, group_members


def dilated_scales(size: int, num_scales: int, min_scale: int) -> list[int]:
    """`num_scales` subgroup sizes evenly spaced (rounded half up) from the group size down to `min_scale`, unique."""
    if size < min_scale:
        return []
    stride = (size - min_scale) / max(num_scales - 1, 1)
    return sorted({int(size - k * stride + 0.5) for k in range(num_scales)}, reverse=True)


def subgroups(size: int, scale: int, draws: int, groups: int, generator: torch.Generator | None) -> Tensor:
    """Member positions of size-`scale` subgroups containing each member: [groups, size, S, scale], own first.

    Every subgroup when there are at most `draws` of them (S = C(size − 1, scale − 1)), else `draws` subgroups drawn
    uniformly (S = draws), independently for every member of every group.
    """
    if math.comb(size - 1, scale - 1) <= draws:
        rows = [
            [(i, *others) for others in combinations([j for j in range(size) if j != i], scale - 1)]
            for i in range(size)
        ]
        return torch.tensor(rows, dtype=torch.long).reshape(size, -1, scale).expand(groups, -1, -1, -1)  # [g, n, S, τ]
    device = generator.device if generator is not None else None
    keys = torch.rand(groups, size, draws, size, generator=generator, device=device)  # [g, n, S, n]
    keys = keys + 2 * torch.eye(size, device=keys.device)[None, :, None, :]  # own position always ranks first
    return keys.topk(scale, dim=-1).indices  # [g, n, S, scale]


@ADVANTAGES.register("ms_grpo", paper="OpenReview:ktHj6YazEE")
def ms_grpo(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    num_scales: int = 4,
    min_scale: int = 2,
    subgroups_per_scale: int = 4,
    std_min_scale: int = 3,
    eps: float = 1e-6,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Multi-scale GRPO: A_i = Σ_τ w_τ·mean_{S ∋ i, |S| = τ} (r_i − mean_S r)/(std_S r + eps), uniform w_τ.

    Verified (abstract only, no arXiv id or code): subgroup advantages at several scales, "dilated scale sampling"
    and "diversity-aware subgroup selection". Unverified details, implemented as the design spec's most defensible
    form: scales are `num_scales` evenly spaced sizes from G down to `min_scale` (4 and 2, community defaults; the
    full group is always one, so `num_scales=1` is GRPO); at each scale `subgroups_per_scale` (4) subgroups
    containing i are drawn uniformly with `generator` (every subgroup when there are no more, which makes small
    groups deterministic); scales below `std_min_scale` (3) use the mean-only (r_i − mean_S r), as the std of two
    items is degenerate. A group smaller than `min_scale` gets 0. rewards [B], group_ids [B] -> advantages [B].
    Paper: OpenReview ktHj6YazEE (ICLR 2026 submission; no arXiv id).
    """
    batch = check_rewards(rewards, group_ids)
    all_members = group_members(group_index(group_ids, batch))  # [G, S]
    sizes = (all_members >= 0).sum(1)  # [G]
    advantages = torch.zeros_like(rewards)  # [B]
    for size in torch.unique(sizes).tolist():  # groups of one size at a time
        members = all_members[sizes == size, :size]  # [g, n]
        group_rewards = rewards[members]  # [g, n]
        scales = dilated_scales(size, num_scales, min_scale)
        for scale in scales:
            picks = subgroups(size, scale, subgroups_per_scale, len(members), generator)  # [g, n, S, τ]
            picks = picks.to(rewards.device)
            values = group_rewards[:, None, None, :].expand(*picks.shape[:3], size).gather(-1, picks)  # [g, n, S, τ]
            deviation = values[..., 0] - values.mean(-1)  # [g, n, S]
            if scale >= std_min_scale:
                std = values.std(-1)  # [g, n, S]
                deviation = torch.where(std > 0, deviation / (std + eps), 0.0)  # [g, n, S]
            advantages[members] += deviation.mean(-1) / len(scales)  # [g, n]
    return advantages

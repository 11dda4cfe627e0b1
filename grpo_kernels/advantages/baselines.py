"""Baseline-and-scale estimators: each subtracts a group (or cached) baseline from the reward, some then rescale.

All take rewards [B] (GDPO: [B, K]) and group_ids [B] and return advantages [B]. A group of one, or a group whose
rewards are all equal, has no relative signal and gets 0 from every group-normalised estimator here (verl's GRPO
and RLOO instead give a group of one mean 0 and std 1, i.e. A = r/(1 + eps) and A = r).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.checks import check_ids, check_rewards, checked_floats
from grpo_kernels.groups import group_deviation, group_index, group_varies, group_zscore, subgroup_index


def batch_moments(values: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Batch mean and unbiased variance of `values` [B], each element counted `weights` times (default once)."""
    weights = torch.ones_like(values) if weights is None else weights  # [B]
    total = weights.sum()
    mean = (weights * values).sum() / total
    var = (weights * (values - mean) ** 2).sum() / (total - 1).clamp(min=1)
    return mean, var


@ADVANTAGES.register("grpo", paper="arXiv:2402.03300")
def grpo(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Group z-score A_i = (r_i − mean_G r)/(std_G r + eps), GRPO's outcome advantage.

    std_G is unbiased (torch's default). eps = 1e-6 as in verl; TRL uses 1e-4. Zero-variance groups get 0.
    rewards [B], group_ids [B] -> advantages [B]. Paper: DeepSeekMath, arXiv:2402.03300, §4.1.2.
    """
    batch = check_rewards(rewards, group_ids)
    return group_zscore(rewards, group_index(group_ids, batch), eps)  # [B]


@ADVANTAGES.register("dr_grpo", paper="arXiv:2503.20783")
def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO's unbiased advantage A_i = r_i − mean_G r: no std division, which biases toward easy/hard prompts.

    rewards [B], group_ids [B] -> advantages [B]. Paper: Liu et al., arXiv:2503.20783.
    """
    batch = check_rewards(rewards, group_ids)
    return group_deviation(rewards, group_index(group_ids, batch))[1]  # [B]


@ADVANTAGES.register("rloo", paper="arXiv:2402.14740")
def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Leave-one-out baseline A_i = r_i − mean_{j≠i} r_j = G/(G − 1)·(r_i − mean_G r).

    A group of one has no other sample to compare with and gets 0. rewards [B], group_ids [B] -> advantages [B].
    Paper: Ahmadian et al., arXiv:2402.14740.
    """
    batch = check_rewards(rewards, group_ids)
    size, deviation, _ = group_deviation(rewards, group_index(group_ids, batch))  # [B], [B]
    return size / (size - 1).clamp(min=1) * deviation  # [B]


@ADVANTAGES.register("reinforce_pp", paper="arXiv:2501.03262")
def reinforce_pp(rewards: Tensor, group_ids: Tensor, *, lengths: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """REINFORCE++-baseline: Ã_i = r_i − mean_G r, then whitened over the batch, A = (Ã − mean_b)/√(var_b + eps).

    The batch variance is unbiased and eps = 1e-8 sits under the square root, as in verl's `masked_whiten`. verl
    whitens the advantage broadcast to every valid token, so each sequence counts |o_i| times; pass `lengths` [B]
    (valid token counts) to reproduce that, or leave it None to count each sequence once.
    rewards [B], group_ids [B] -> advantages [B]. Paper: Hu et al., arXiv:2501.03262.
    """
    batch = check_rewards(rewards, group_ids)
    weights = None if lengths is None else checked_floats("lengths", lengths, (batch,), dtype=rewards.dtype)
    centred = group_deviation(rewards, group_index(group_ids, batch))[1]  # [B]
    mean, var = batch_moments(centred, weights)
    return (centred - mean) * torch.rsqrt(var + eps)  # [B]


@ADVANTAGES.register("pvpo", paper="arXiv:2508.21104")
def pvpo(rewards: Tensor, group_ids: Tensor, *, reference_value: Tensor) -> Tensor:
    """PVPO static-value advantage A_i = r_i − V̂(q): a cached baseline, no std division.

    V̂(q) = mean_{j=1..M} r^ref_j is the mean reward of M rollouts of a fixed reference policy on prompt q, made
    before training and refreshed every few steps (the cache lives with the trainer). `reference_value` [B] holds
    each sequence's prompt value and must be equal within a group. rewards [B], group_ids [B] -> advantages [B].
    Paper: Feng et al., arXiv:2508.21104.
    """
    batch = check_rewards(rewards, group_ids)
    value = checked_floats("reference_value", reference_value, (batch,), dtype=rewards.dtype)  # [B]
    if group_varies(value, group_index(group_ids, batch)).any():
        raise ValueError("reference_value must be equal within each group (one cached value per prompt)")
    return rewards - value  # [B]


@ADVANTAGES.register("gdpo", paper="arXiv:2601.05242")
def gdpo(
    rewards: Tensor, group_ids: Tensor, *, weights: Sequence[float] | Tensor | None = None, eps: float = 1e-4
) -> Tensor:
    """GDPO decoupled multi-reward advantage: normalise each reward in its group, weight-sum, then batch-normalise.

    a_{i,k} = (r_{i,k} − mean_G r_k)/(std_G r_k + eps);  ã_i = Σ_k w_k a_{i,k};  A_i = (ã_i − mean_b ã)/(std_b ã + eps),
    with unbiased stds and eps = 1e-4 as in NVlabs/GDPO's TRL patch (verl's patch whitens over tokens instead).
    Summing first, as GRPO does, collapses different reward combinations onto the same advantage.
    rewards [B, K], group_ids [B], weights [K] (default all 1) -> advantages [B]. Paper: Liu et al., arXiv:2601.05242.
    """
    batch = check_rewards(rewards, group_ids, "B, K")
    num_rewards = rewards.shape[1]
    weight = torch.ones(num_rewards) if weights is None else weights
    weight = checked_floats("weights", weight, (num_rewards,), "K", rewards.dtype).to(rewards.device)  # [K]
    per_reward = group_zscore(rewards, group_index(group_ids, batch), eps)  # [B, K]
    summed = per_reward @ weight  # [B]
    mean, var = batch_moments(summed)
    std = var.sqrt()
    return torch.where(std > 0, (summed - mean) / (std + eps), 0.0)  # [B]


@ADVANTAGES.register("stratified", paper="arXiv:2510.06214")
def stratified(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    strata: Tensor,
    alpha: float = 1.0,
    per_group: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Stratified advantage normalisation (SAN): z-score inside strata of structurally alike trajectories.

    A^SAN_i = (R_i − mean_{B_k} R)/(std_{B_k} R + eps) for τ_i in stratum B_k (e.g. by number of search calls);
    A^GN_i = (R_i − mean R)/(std R + eps) over all strata; A_i = α·A^SAN_i + (1 − α)·A^GN_i (α = 1 by default,
    the community value; the paper's is not retrieved). Unverified: whether strata are formed per prompt group
    (`per_group=True`, default: strata split each group and A^GN is the group's GRPO advantage) or over the whole
    batch (`per_group=False`). rewards [B], group_ids [B], strata [B] int -> advantages [B].
    Paper: Zhu et al., arXiv:2510.06214 (SAN and its blend with global normalisation).
    """
    batch = check_rewards(rewards, group_ids)
    check_ids("strata", strata, batch)
    whole = group_index(group_ids, batch) if per_group else torch.zeros_like(group_ids)  # [B]
    stratum = subgroup_index(whole, strata)  # [B]
    san = group_zscore(rewards, stratum, eps)  # [B]
    return alpha * san + (1 - alpha) * group_zscore(rewards, whole, eps)  # [B]


@ADVANTAGES.register("tic_grpo", paper="arXiv:2508.02833")
def tic_grpo(rewards: Tensor, group_ids: Tensor, *, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """Length-corrected group z-score of r_i/|o_i| (the community composer's reading of TIC-GRPO; UNVERIFIED).

    A_i = (r_i/|o_i| − mean_G(r/|o|))/(std_G(r/|o|) + eps). TIC-GRPO's verified change is the trajectory-level
    importance ratio (a loss term, not an advantage); the paper's abstract mentions no length correction, so this
    estimator follows the port only. With equal lengths it equals `grpo` on rewards/length.
    rewards [B], group_ids [B], lengths [B] (> 0 valid tokens) -> advantages [B]. Paper: Pang et al., arXiv:2508.02833.
    """
    batch = check_rewards(rewards, group_ids)
    length = checked_floats("lengths", lengths, (batch,), dtype=rewards.dtype)  # [B]
    if (length <= 0).any():
        raise ValueError("lengths must be positive (valid tokens per sequence)")
    return group_zscore(rewards / length, group_index(group_ids, batch), eps)  # [B]

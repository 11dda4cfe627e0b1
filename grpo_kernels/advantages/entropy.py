"""GTPO and GRPO-S: rewards redistributed by policy entropy, at token level (GTPO) and sequence level (GRPO-S).

Both split each group into O⁺ (correct) and O⁻ (incorrect). A correct response's share of the reward grows with its
entropy (uncertain decisions on a right path earn credit); a wrong response's penalty share grows with its inverse
entropy (confident mistakes cost most). Shaped rewards are then standardised separately within O⁺ and within O⁻ of
each group (Eq. 6 as read by a third-party port; the paper's equations were not checked directly: partial).
Consequence of that reading, kept as stated: with binary rewards the α₁ term is constant inside each set and
cancels, so only the entropy redistribution survives, and a set holding a single response gets 0.
The entropy is the detached full-vocabulary H_{i,t} from the vocabulary pass (or the rollout's old-policy pass).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.checks import check_finite, check_rewards, check_shape, checked_flags
from grpo_kernels.groups import group_index, group_sum, group_zscore, subgroup_index


def shaped_rewards(
    rewards: Tensor, entropy: Tensor, active: Tensor, correct: Tensor, subset: Tensor, alpha1: float, alpha2: float
) -> Tensor:
    """r̃ = α₁r + α₂·(H/Σ_{O⁺} H)·d for O⁺, −α₁ − α₂·((1/H)/Σ_{O⁻} 1/H)·h for O⁻ ([B] or [B, T] like `entropy`).

    Sums and counts d, h run over the active members of the same (group, O±) `subset`, position by position.
    `entropy` must already be positive where `active`; inactive entries contribute nothing.
    """
    flag = correct.view(-1, *[1] * (entropy.ndim - 1))  # [B, 1] or [B]
    weight = torch.where(active, torch.where(flag, entropy, 1 / entropy), 0.0)  # [B, T] or [B]
    total = group_sum(weight, subset)  # [B, T] or [B]
    share = torch.where(total > 0, weight / total, 0.0) * group_sum(active.to(weight.dtype), subset)  # [B, T] or [B]
    reward = rewards.view_as(flag)  # [B, 1] or [B]
    return torch.where(flag, alpha1 * reward + alpha2 * share, -alpha1 - alpha2 * share)  # [B, T] or [B]


def checked_inputs(
    rewards: Tensor, group_ids: Tensor, entropy: Tensor, mask: Tensor, correctness: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GTPO's and GRPO-S's inputs, checked: (entropy [B, T], mask [B, T] bool, correctness [B] bool, subset [B]).

    `entropy` comes back in rewards' dtype, floored at eps and 1 at padding (where it may hold NaN); `subset` is the
    dense index of each response's (group, O±) set.
    """
    batch = check_rewards(rewards, group_ids)
    check_shape("entropy", entropy, (batch, None), "B, T")
    valid = checked_flags("mask", mask, tuple(entropy.shape), "B, T")  # [B, T]
    check_finite("entropy", torch.where(valid, entropy, 0.0))
    correct = checked_flags("correctness", correctness, (batch,))  # [B]
    subset = subgroup_index(group_index(group_ids, batch), correct)  # [B] (group, O±)
    return entropy.to(rewards.dtype).masked_fill(~valid, 1.0).clamp(min=eps), valid, correct, subset


@ADVANTAGES.register("gtpo", paper="arXiv:2508.04349")
def gtpo(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    entropy: Tensor,
    mask: Tensor,
    correctness: Tensor,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    eps: float = 1e-6,
) -> Tensor:
    """GTPO token-level entropy-shaped advantage A_{i,t} (Tan et al., Eqs. 3, 5 and 6 as read by a port).

    o_i ∈ O⁺: r̃_{i,t} = α₁·r_i + α₂·(H_{i,t}/Σ_{k∈O⁺ active at t} H_{k,t})·d_t;
    o_j ∈ O⁻: r̃_{j,t} = −α₁ − α₂·((1/H_{j,t})/Σ_{k∈O⁻ active at t} 1/H_{k,t})·h_t;
    d_t (h_t) = number of O⁺ (O⁻) responses of the group still active at position t. Then A = z-score of r̃ over
    all valid tokens of the response's (group, O±) set, unbiased std + eps. α₁ = 1, α₂ = 0.1 as in the paper's
    experiments (per the port). H is floored at eps. Masked positions get 0.
    rewards [B], group_ids [B], entropy [B, T], mask [B, T], correctness [B] bool -> advantages [B, T].
    Paper: Tan et al., arXiv:2508.04349.
    """
    entropy, valid, correct, subset = checked_inputs(rewards, group_ids, entropy, mask, correctness, eps)
    shaped = shaped_rewards(rewards, entropy, valid, correct, subset, alpha1, alpha2)  # [B, T]
    token_subset = subset[:, None].expand_as(valid)[valid]  # [N] valid tokens
    advantages = torch.zeros_like(shaped)  # [B, T]
    advantages[valid] = group_zscore(shaped[valid], group_index(token_subset, len(token_subset)), eps)  # [N]
    return advantages


@ADVANTAGES.register("grpo_s", paper="arXiv:2508.04349")
def grpo_s(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    entropy: Tensor,
    mask: Tensor,
    correctness: Tensor,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO-S sequence-level entropy-shaped advantage: GTPO's shaping with each response's mean entropy Ĥ_i.

    Ĥ_i = mean of H_{i,t} over valid tokens; o_i ∈ O⁺: r̂_i = α₁·r_i + α₂·(Ĥ_i/Σ_{k∈O⁺} Ĥ_k)·|O⁺|;
    o_j ∈ O⁻: r̂_j = −α₁ − α₂·((1/Ĥ_j)/Σ_{k∈O⁻} 1/Ĥ_k)·|O⁻|; A = z-score of r̂ within the group's O⁺ or O⁻.
    The paper states only "the same design at sequence level"; this exact form is UNVERIFIED. Ĥ is floored at eps.
    rewards [B], group_ids [B], entropy [B, T], mask [B, T], correctness [B] bool -> advantages [B].
    Paper: Tan et al., arXiv:2508.04349.
    """
    entropy, valid, correct, subset = checked_inputs(rewards, group_ids, entropy, mask, correctness, eps)
    weights = valid.to(rewards.dtype)  # [B, T]
    mean_entropy = ((entropy * weights).sum(1) / weights.sum(1).clamp(min=1)).clamp(min=eps)  # [B]
    active = torch.ones_like(correct)  # [B] every response counts
    shaped = shaped_rewards(rewards, mean_entropy, active, correct, subset, alpha1, alpha2)  # [B]
    return group_zscore(shaped, subset, eps)  # [B]

"""Correctness-aware estimators: a group advantage reshaped by the verifier's verdict on each response."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.checks import check_rewards, checked_flags, checked_floats
from grpo_kernels.groups import group_deviation, group_index, group_mean, group_zscore


@ADVANTAGES.register("grpo_lead", paper="arXiv:2504.09696")
def grpo_lead(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    correctness: Tensor,
    weight_min: float = 0.4,
    weight_max: float = 1.5,
    midpoint: float = 0.75,
    steepness: float = 10.0,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO-LEAD difficulty-aware advantage: the group z-score reweighted by a logistic of the prompt's pass rate.

    Ã_i = (r_i − mean_G r)/(std_G r + eps);  w(x) = A + (B − A)/(1 + exp(k(x − x_0)));  μ_q = #correct/G;
    A'_i = Ã_i·w(μ_q) if Ã_i > 0, else Ã_i·w(1 − μ_q)  (w evaluated at 1 − μ, not 1 − w(μ)).
    Defaults are the official code's: A = `weight_min` = 0.4, B = `weight_max` = 1.5, x_0 = `midpoint` = 0.75,
    k = `steepness` = 10. Hard prompts (low μ) amplify positive advantages, easy ones negative advantages.
    `rewards` are GRPO-LEAD's length-dependent rewards (exp(−α·z) if correct, −1 if not), made by the reward stage.
    rewards [B], group_ids [B], correctness [B] bool -> advantages [B]. Paper: Zhang & Zuo, arXiv:2504.09696.
    """
    batch = check_rewards(rewards, group_ids)
    correct = checked_flags("correctness", correctness, (batch,)).to(rewards.dtype)  # [B]
    index = group_index(group_ids, batch)  # [B]
    advantages = group_zscore(rewards, index, eps)  # [B]
    pass_rate = group_mean(correct, index)  # [B]

    def weight(x: Tensor) -> Tensor:
        return weight_min + (weight_max - weight_min) / (1 + torch.exp(steepness * (x - midpoint)))  # [B]

    return advantages * torch.where(advantages > 0, weight(pass_rate), weight(1 - pass_rate))  # [B]


@ADVANTAGES.register("rank_grpo", paper="arXiv:2601.23058")
def rank_grpo(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    correctness: Tensor,
    scale_rewards: bool = True,
    correct_floor: float = 0.0,
    incorrect_ceiling: float = 0.0,
    eps: float = 1e-6,
) -> Tensor:
    """RankGRPO (RLRR) correctness-aware clipping: correct → max(A, ξ⁻), incorrect → min(A, ξ⁺).

    A_i = (s_i − mean_G s)/F, F = std_G s + eps (`scale_rewards`, TRL's name) or 1, on the rank-shaped rewards s.
    With ξ⁻ = `correct_floor` ≥ 0 ≥ ξ⁺ = `incorrect_ceiling` a correct response is never pushed down and a wrong one
    never up: the paper's stated intent, hence the defaults 0 and 0. The community port's ξ⁻ = −0.5, ξ⁺ = +0.5 do
    not guarantee this. The formula (and F) come from that port only (partial verification).
    rewards [B], group_ids [B], correctness [B] bool -> advantages [B]. Paper: Niu et al. (RLRR), arXiv:2601.23058.
    """
    batch = check_rewards(rewards, group_ids)
    correct = checked_flags("correctness", correctness, (batch,))  # [B]
    index = group_index(group_ids, batch)  # [B]
    centred = group_zscore(rewards, index, eps) if scale_rewards else group_deviation(rewards, index)[1]  # [B]
    return torch.where(correct, centred.clamp(min=correct_floor), centred.clamp(max=incorrect_ceiling))  # [B]


@ADVANTAGES.register("xrpo", paper="arXiv:2510.06672")
def xrpo(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    correctness: Tensor,
    mean_logp: Tensor,
    novelty_weight: float = 1.0,
    novelty_cap: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """XRPO novelty sharpening: correct responses unlikely under the policy get a bonus on their GRPO advantage.

    s_i = (1/|o_i|) Σ_t ℓ_{i,t} (`mean_logp`, from the rollout); η_i = exp(s_i − mean_G s);
    A⁺_i = A_i + min(max(λ(1 − η_i), 0), κ·A_i) for correct responses, A_i otherwise, with A_i the GRPO z-score.
    Form and defaults λ = `novelty_weight` = 1, κ = `novelty_cap` = 1 come from the community port (unverified); as
    stated there, a correct response with A_i < 0 (non-binary rewards) gets κ·A_i added.
    rewards [B], group_ids [B], correctness [B] bool, mean_logp [B] -> advantages [B].
    Paper: Bamba et al., arXiv:2510.06672.
    """
    batch = check_rewards(rewards, group_ids)
    correct = checked_flags("correctness", correctness, (batch,))  # [B]
    seq_logp = checked_floats("mean_logp", mean_logp, (batch,), dtype=rewards.dtype)  # [B]
    index = group_index(group_ids, batch)  # [B]
    advantages = group_zscore(rewards, index, eps)  # [B]
    novelty = torch.exp(group_deviation(seq_logp, index)[1])  # [B] η_i
    bonus = torch.minimum((novelty_weight * (1 - novelty)).clamp(min=0), novelty_cap * advantages)  # [B]
    return advantages + torch.where(correct, bonus, 0.0)  # [B]

"""KRPO: a scalar Kalman filter over each group's rewards, in sampling order, as the baseline and scale."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.checks import check_rewards
from grpo_kernels.groups import group_first, group_index, group_rank

INITIAL_MEAN = 0.0  # x_0 of the official code
INITIAL_VAR = 1.0  # P_0 of the official code


@dataclass
class KalmanState:
    """Per-prompt filter state {prompt id: (x, P)} carried from step to step: KRPO's NON-official persistent mode.

    The official code (billhhh/KRPO_LLMs_RL, `group_advantages`) re-initialises the filter at x = 0, P = 1 for every
    group at every step; carrying it across steps is the community composer's reading ("history across steps"),
    offered here as an extension. A prompt id seen for the first time starts at x = 0, P = 1. `krpo` updates
    `filters` in place with each group's final posterior.
    """

    filters: dict[int, tuple[float, float]] = field(default_factory=dict)


@ADVANTAGES.register("krpo", paper="arXiv:2505.07527")
def krpo(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    process_var: float = 1e-5,
    meas_var: float = 1e-2,
    eps: float = 1e-8,
    state: KalmanState | None = None,
) -> Tensor:
    """Kalman-filter baseline: A_j = (r_j − x_j)/(√P_j + eps), a scan over each group in sampling (batch) order.

    Per group, from x_0 = 0, P_0 = 1: P⁻_j = P_{j−1} + Q;  K_j = P⁻_j/(P⁻_j + R);  x_j = x_{j−1} + K_j(r_j − x_{j−1});
    P_j = (1 − K_j)P⁻_j. The advantage uses the posterior x_j, which already includes r_j. Defaults are the official
    code's: Q = `process_var` = 1e-5, R = `meas_var` = 1e-2, eps = 1e-8, and the filter restarts for every group.
    The result depends on the order of a group's rewards; magnitudes are ~10x GRPO's (√P_j ≈ 0.1/√j) and the
    first sample gets ≈ 0.1·r_1.

    `state`: the non-official persistent mode (see `KalmanState`); each group then starts from, and writes back,
    the filter of its id, so pass stable prompt ids (e.g. dataset indices) as `group_ids`.
    rewards [B], group_ids [B] -> advantages [B]. Paper: Wang et al., arXiv:2505.07527 (code: billhhh/KRPO_LLMs_RL).
    """
    batch = check_rewards(rewards, group_ids)
    index = group_index(group_ids, batch)  # [B]
    ids = group_ids[group_first(index)]  # [G] id of each group
    position = group_rank(torch.arange(batch, device=index.device), index)  # [B] place inside its group
    fresh = (INITIAL_MEAN, INITIAL_VAR)
    priors = [fresh if state is None else state.filters.get(key, fresh) for key in ids.tolist()]
    mean, var = torch.tensor(priors, dtype=rewards.dtype, device=rewards.device).reshape(-1, 2).T.contiguous()  # [G]
    advantages = torch.empty_like(rewards)  # [B]
    for step in range(int(position.max()) + 1 if batch else 0):  # one step for every group at once
        members = (position == step).nonzero().squeeze(1)  # [G_step] at most one per group
        group = index[members]  # [G_step]
        predicted = var[group] + process_var  # [G_step]
        gain = predicted / (predicted + meas_var)  # [G_step]
        mean[group] = mean[group] + gain * (rewards[members] - mean[group])
        var[group] = (1 - gain) * predicted
        advantages[members] = (rewards[members] - mean[group]) / (var[group].sqrt() + eps)  # [G_step]
    if state is not None:
        state.filters.update(zip(ids.tolist(), zip(mean.tolist(), var.tolist(), strict=True), strict=True))
    return advantages

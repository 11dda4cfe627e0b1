"""Several text rewards at once: the GDPO reward matrix [B, K] and a weighted sum [B]."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import check_finite, check_texts
from grpo_kernels.rewards import REWARDS

TextReward = Callable[..., Tensor]  # fn(completions: list[str], **kwargs) -> Tensor [B]


def _name(reward: TextReward) -> str:
    return getattr(reward, "__name__", type(reward).__name__)


@REWARDS.register("gdpo_multi", paper="GDPO, arXiv:2601.05242")
class MultiReward:
    """The reward matrix r_{i,k} [B, K] of K text rewards, one column each, and their weights w_k [K].

    GDPO (Liu et al., arXiv:2601.05242; spec §9) normalises each reward column within the group *before*
    combining, so the columns stay separate here; the decoupled advantage (advantages.py) takes this matrix and
    `weights` and computes Σ_k w_k · (r_{·,k} − mean_G) / (std_G + 1e-4), then batch-normalises. Summing first
    (`WeightedSum`) would map different reward combinations to the same advantage. Every reward is called with
    the same `completions` and keyword arguments.
    """

    def __init__(self, rewards: Sequence[TextReward], weights: Sequence[float] | None = None) -> None:
        if len(rewards) == 0 or not all(callable(r) for r in rewards):
            raise ValueError(f"rewards must be a non-empty sequence of callables, got {rewards!r}")
        self.rewards = list(rewards)
        self.weights = torch.ones(len(rewards)) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
        if self.weights.shape != (len(self.rewards),):
            raise ValueError(f"weights must have one entry per reward ({len(self.rewards)}), got {weights!r}")
        check_finite("weights", self.weights)

    def __call__(self, completions: list[str], **kwargs) -> Tensor:
        """Rewards [B, K] float32, column k from `rewards[k]`."""
        completions = check_texts("completions", completions)
        columns = []
        for reward in self.rewards:
            column = reward(completions, **kwargs)
            if not isinstance(column, Tensor) or column.shape != (len(completions),):
                got = list(column.shape) if isinstance(column, Tensor) else type(column).__name__
                raise ValueError(f"reward {_name(reward)} must return a tensor [B] = [{len(completions)}], got {got}")
            check_finite(f"reward {_name(reward)}", column)
            columns.append(column.float())
        return torch.stack(columns, dim=-1)  # [B, K]


@REWARDS.register("weighted_sum", paper="summed rule rewards (accuracy + format), DeepSeek-R1, arXiv:2501.12948")
class WeightedSum:
    """R_i = Σ_k w_k · r_k(completion_i), e.g. `WeightedSum([(gsm8k, 1.0), (format_reward, 0.5)])`.

    The usual RLVR reward (DeepSeek-R1, arXiv:2501.12948: accuracy plus format). Each reward is called with the
    same `completions` and keyword arguments; returns [B] float32. For GDPO keep the columns (`MultiReward`).
    """

    def __init__(self, terms: Sequence[tuple[TextReward, float]]) -> None:
        if len(terms) == 0 or not all(isinstance(t, tuple) and len(t) == 2 for t in terms):
            raise ValueError(f"terms must be a non-empty sequence of (reward, weight) pairs, got {terms!r}")
        self.columns = MultiReward([reward for reward, _ in terms], [weight for _, weight in terms])

    def __call__(self, completions: list[str], **kwargs) -> Tensor:
        """Weighted sum [B] float32."""
        matrix = self.columns(completions, **kwargs)  # [B, K]
        return matrix @ self.columns.weights.to(matrix.device)  # [B]

"""GRPO on a non-LLM policy: a K-armed bandit whose arm rewards drift, trained with the same loss and advantages.

The policy only has to produce actions and their log-probs, and the reward model only scores actions: here the
policy is K logits (one "token" per round, the arm), a round's G pulls form one group, the group z-score advantage
comes from the `ADVANTAGES` registry and the update is `grpo_kernels.grpo_loss` on logits [G, 1, K] with the
clipped surrogate and μ inner updates, exactly as the LLM trainer does on [B, T, V].

The arms' mean rewards drift: all of them move together by a random walk (which the group-relative advantage
cancels: only differences within a round matter) and each wobbles on its own sinusoid; the best arm keeps a margin
larger than the wobble, so "converged" is well defined: the policy puts >= 90 % of its mass on it.

    python examples/bandit.py            # prints the probability of the best arm as it learns

The mean reward it prints wanders (it may fall below zero while the policy has converged): the common random walk
moves every arm's reward; the reward minus the best arm's current mean (the last column, averaged over the rounds
since the previous line, near 0 once converged) is what the policy controls.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from grpo_kernels import ADVANTAGES, grpo_loss


@dataclass(frozen=True)
class BanditConfig:
    arms: int = 5
    steps: int = 200  # rounds; each is one group of `group_size` pulls
    group_size: int = 16  # G
    num_iterations: int = 4  # μ inner updates per round (the clipped ratio keeps them close to the sampler)
    learning_rate: float = 0.05
    epsilon: float = 0.2  # clip range (loss option epsilon)
    noise: float = 1.0  # std of a pull's reward around its arm's mean
    walk: float = 0.1  # std of the common random walk's step
    wobble: float = 0.1  # amplitude of each arm's own sinusoidal drift
    gap: float = 0.3  # mean-reward gap between neighbouring arms (> 2 · wobble keeps the best arm best)
    seed: int = 0


class Policy(Protocol):
    """What GRPO needs from a policy: sampled actions with their log-probs, and differentiable logits."""

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]: ...

    def logits(self) -> Tensor: ...


class RewardModel(Protocol):
    def score(self, actions: Tensor, step: int) -> Tensor: ...


class SoftmaxPolicy(nn.Module):
    """π(a) = softmax(θ)_a over K arms, θ = 0 at the start (uniform)."""

    def __init__(self, arms: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(arms))

    def logits(self) -> Tensor:
        return self.theta  # [K]

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(self.theta, dim=-1)  # [K]
        actions = torch.multinomial(logp.exp(), n, replacement=True, generator=generator)  # [n]
        return actions, logp[actions]  # [n], [n]


class DriftingBandit:
    """Arm k's mean reward at round t: k · gap (shuffled) + common random walk + wobble · sin(t / 10 + phase_k)."""

    def __init__(self, config: BanditConfig, generator: torch.Generator) -> None:
        self.config, self.generator = config, generator
        self.base = torch.randperm(config.arms, generator=generator).float() * config.gap  # [K]
        self.phase = torch.rand(config.arms, generator=generator) * 2 * math.pi  # [K]
        self.level = 0.0

    @property
    def best_arm(self) -> int:
        return int(self.base.argmax())

    def means(self, step: int) -> Tensor:
        return self.base + self.level + self.config.wobble * torch.sin(step / 10 + self.phase)  # [K]

    def score(self, actions: Tensor, step: int) -> Tensor:
        self.level += self.config.walk * float(torch.randn((), generator=self.generator))
        noise = self.config.noise * torch.randn(len(actions), generator=self.generator)  # [G]
        return self.means(step)[actions] + noise  # [G]


def train(config: BanditConfig = BanditConfig(), log_every: int = 0) -> list[dict]:
    """GRPO on the drifting bandit; returns per round the probability of the best arm and the mean reward."""
    generator = torch.Generator().manual_seed(config.seed)
    bandit, policy = DriftingBandit(config, generator), SoftmaxPolicy(config.arms)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
    advantage_fn = ADVANTAGES.get("grpo")
    group = torch.zeros(config.group_size, dtype=torch.long)  # every pull of a round is in group 0
    history = []
    for step in range(config.steps):
        actions, old_logp = policy.sample(config.group_size, generator)  # [G], [G]
        rewards = bandit.score(actions, step)  # [G]
        advantages = advantage_fn(rewards, group)  # [G]
        for _ in range(config.num_iterations):
            logits = policy.logits()[None, None, :].repeat(config.group_size, 1, 1)  # [G, 1, K]: T = 1 token
            out = grpo_loss(
                logits, actions[:, None], advantages, old_logp[:, None], loss_type="grpo", epsilon=config.epsilon
            )
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        p_best = torch.softmax(policy.logits().detach(), -1)[bandit.best_arm].item()
        behind = rewards.mean().item() - bandit.means(step).max().item()  # the noise aside, 0 when all pulls are best
        history.append({"step": step, "p_best": p_best, "reward": rewards.mean().item(), "behind": behind})
        if log_every and step % log_every == 0:
            recent = [h["behind"] for h in history[-log_every:]]  # averaged over rounds: the pulls' noise shrinks
            print(
                f"round {step:4d}   P(best arm) {p_best:.3f}   mean reward {rewards.mean():+.2f}   "
                f"{sum(recent) / len(recent):+.2f}"
            )
    return history


if __name__ == "__main__":
    print("The mean reward drifts with all arms (a common random walk); the last column, the reward minus the best")
    print("arm's current mean (averaged over the last 20 rounds), is what the policy controls: it goes to ~0 as")
    print("P(best arm) -> 1.")
    cap = os.environ.get("GRPO_KERNELS_MAX_STEPS")  # the variable shortens quick checks
    result = train(BanditConfig(steps=min(BanditConfig.steps, int(cap))) if cap else BanditConfig(), log_every=20)
    print(f"final P(best arm) = {result[-1]['p_best']:.3f}")

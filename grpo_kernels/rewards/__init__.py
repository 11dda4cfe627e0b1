"""Rewards of the GRPO family, registered by name in `REWARDS`.

Two signatures:

- **text rewards** score completion strings one by one:
  `fn(completions: list[str], **kwargs) -> Tensor [B] float32`. Keyword arguments carry the dataset columns
  (`answers`, `targets`, `numbers`, ...); a reward ignores the ones it does not use, so one call can feed
  several rewards (`WeightedSum`, `MultiReward`), as TRL's reward functions are fed.
  Registered: `math_answer`, `gsm8k`, `countdown`, `format`, `weighted_sum` and `gdpo_multi` (classes built
  from text rewards; `gdpo_multi` returns the matrix [B, K]).
- **group / tensor rewards** reshape per-sequence quantities: `fn(<per-sequence inputs [B]>, group_ids, *,
  options) -> Tensor [B] float32`, with `group_ids` one id per completion (an integer tensor [B] or a list of
  hashable ids; groups may be of any size and need not be contiguous). Registered: `gapo_frequency`,
  `dra_diversity` (a class holding the `embed` callable), `grpo_lead_length`, `rank_grpo`, `unlikeliness`;
  `p_grpo_posterior`, `spo_trajectory` and `dapo_overlong` are per-sequence and take no groups.

Inputs are checked first: a list or tensor whose length is not B, NaN or ±inf, or a value out of range is a
ValueError naming the argument. Rewards are computed outside the kernel (spec §24, "Outside").

Completions are untrusted: every text reward has a size and a time limit that hold in any thread (limits.py): a
completion over `limits.MAX_COMPLETION_CHARS`, a Countdown equation over `countdown.MAX_EQUATION_CHARS`, or a math
answer that is too big or takes longer than `math_answer.TIMEOUT_SECONDS` (run in a worker process that is killed
then) scores 0 and is counted: `limits.over_limit_rows()` per call, the trainer's `rewards/over_limit` per step.

    REWARDS.get("gsm8k")(completions, answers=answers)          # [B]
    REWARDS.names()                                             # every registered reward
"""

# ruff: noqa: E402  (the registry must exist before the modules that register into it are imported)
from grpo_kernels.registry import Registry

REWARDS = Registry("reward")

from grpo_kernels.rewards.combine import MultiReward, WeightedSum
from grpo_kernels.rewards.countdown import countdown
from grpo_kernels.rewards.diversity import DiversityReward
from grpo_kernels.rewards.format_tags import format_reward
from grpo_kernels.rewards.frequency import gapo_frequency
from grpo_kernels.rewards.gsm8k import gsm8k
from grpo_kernels.rewards.lead_length import grpo_lead_length
from grpo_kernels.rewards.math_answer import math_answer
from grpo_kernels.rewards.overlong import dapo_overlong
from grpo_kernels.rewards.posterior import p_grpo_posterior
from grpo_kernels.rewards.rank import rank_grpo
from grpo_kernels.rewards.trajectory_score import spo_trajectory
from grpo_kernels.rewards.unlikeliness import unlikeliness

__all__ = [
    "REWARDS",
    "DiversityReward",
    "MultiReward",
    "WeightedSum",
    "countdown",
    "dapo_overlong",
    "format_reward",
    "gapo_frequency",
    "grpo_lead_length",
    "gsm8k",
    "math_answer",
    "p_grpo_posterior",
    "rank_grpo",
    "spo_trajectory",
    "unlikeliness",
]

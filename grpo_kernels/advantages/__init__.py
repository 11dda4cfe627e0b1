"""Advantage estimators of the GRPO family: per-sequence rewards and group ids in, advantages out.

Each estimator is a function `fn(rewards, group_ids, **hyperparameters) -> advantages` registered by name:

    from grpo_kernels.advantages import ADVANTAGES
    advantages = ADVANTAGES.get("rloo")(rewards, group_ids)        # rewards [B] float, group_ids [B] int -> [B]

Sequences with equal `group_ids` form a group (any sizes, any order). `gdpo` takes rewards [B, K]; `gtpo` returns
[B, T]. Extra inputs (lengths, correctness, entropy, strata, ...) are keyword arguments.
"""

# ruff: noqa: E402  (the registry must exist before the modules that register into it are imported)
from grpo_kernels.registry import Registry

ADVANTAGES = Registry("advantage estimator")

from grpo_kernels.advantages import baselines, entropy, kalman, multiscale, shaped  # noqa: F401 (registers them)
from grpo_kernels.advantages.kalman import KalmanState

__all__ = ["ADVANTAGES", "KalmanState"]

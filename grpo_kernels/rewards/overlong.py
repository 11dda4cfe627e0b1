"""DAPO soft overlong punishment: a length penalty ramping from 0 to −1 over the last `soft_punish_cache` tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import checked_floats
from grpo_kernels.rewards import REWARDS


@REWARDS.register("dapo_overlong", paper="DAPO, arXiv:2503.14476")
def dapo_overlong(
    lengths: Tensor | Sequence[float], *, max_completion_len: int = 20480, soft_punish_cache: int = 4096
) -> Tensor:
    """0 up to L_max − L_cache tokens, then ((L_max − L_cache) − |y|) / L_cache, and −1 beyond L_max.

    DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, §3.4 "Overlong Reward Shaping"; spec §6),
    added to the task reward. The three cases are one clamp: clamp(((L_max − L_cache) − |y|) / L_cache, −1, 0).
    Defaults are the paper's L_max = 20480, L_cache = 4096; the argument names are TRL's
    (`get_soft_overlong_punishment`).
    `lengths` are completion token counts [B]. Returns [B] float32.
    """
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache must be in (0, max_completion_len = {max_completion_len}], got {soft_punish_cache}"
        )
    lengths = checked_floats("lengths", lengths, (len(lengths),), dtype=torch.float32)
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    expected = max_completion_len - soft_punish_cache
    return ((expected - lengths) / soft_punish_cache).clamp(min=-1.0, max=0.0)  # [B]

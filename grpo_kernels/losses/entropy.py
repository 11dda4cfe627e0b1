"""Entropy-based token selection ("Beyond the 80/20 rule", arXiv:2506.01939)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_kernels.losses.reduce import gather_kept


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float, group: Any = None) -> Tensor:
    """Keep the kept tokens whose entropy reaches the (1 − top_quantile) quantile of the kept tokens, [B, T].

    TRL semantics: threshold = torch.quantile(entropy[mask], 1 − q); keep entropy·mask ≥ threshold, within mask.
    With sequences split across `group`, the quantile is of the kept tokens of every rank (an all-gather, O(N)).
    """
    kept = mask.bool()  # [B, T]
    values = gather_kept(entropy[kept], group)  # [M] (every rank's)
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((entropy * mask >= threshold) & kept).to(mask.dtype)  # [B, T]

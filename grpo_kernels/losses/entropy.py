"""Entropy-based token selection ("Beyond the 80/20 rule", arXiv:2506.01939)."""

from __future__ import annotations

import torch
from torch import Tensor


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """Keep the kept tokens whose entropy reaches the (1 − top_quantile) quantile of the kept tokens, [B, T].

    TRL semantics: threshold = torch.quantile(entropy[mask], 1 − q); keep entropy·mask ≥ threshold, within mask.
    """
    kept = mask.bool()  # [B, T]
    if not kept.any():
        return torch.zeros_like(mask)
    threshold = torch.quantile(entropy[kept], 1.0 - top_quantile)
    return ((entropy * mask >= threshold) & kept).to(mask.dtype)  # [B, T]

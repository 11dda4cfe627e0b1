"""The reference policy of the KL penalty: none when `beta == 0`, else a frozen copy of the initial policy,
optionally refreshed from the policy every `ref_model_sync_steps` (TR-DPO's mixing, TRL's `sync_ref_model`:
π_ref ← α·π_θ + (1 − α)·π_ref, Gorbatovski et al., arXiv:2404.09656)."""

from __future__ import annotations

import copy

import torch
from torch import nn


def build_ref_model(model: nn.Module, beta: float) -> nn.Module | None:
    """A frozen copy of `model`, or None when the loss has no KL term (beta == 0)."""
    if beta == 0.0:
        return None
    return copy.deepcopy(model).eval().requires_grad_(False)


@torch.no_grad()
def sync_ref_model(ref_model: nn.Module | None, model: nn.Module, step: int, config) -> None:
    """After optimizer step `step` (1-based): mix the policy into the reference when a refresh is due."""
    if ref_model is None or not config.sync_ref_model or step % config.ref_model_sync_steps != 0:
        return
    alpha = config.ref_model_mixup_alpha
    for ref_param, param in zip(ref_model.parameters(), model.parameters(), strict=True):
        ref_param.mul_(1.0 - alpha).add_(param.detach(), alpha=alpha)

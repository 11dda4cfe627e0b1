"""Baselines the benchmarks compare against; never imported by tests."""

from __future__ import annotations

import torch


def naive_grpo_loss(logits, targets, advantages, old_logp, ref_logp, mask, epsilon=0.2, epsilon_high=0.28, beta=0.04):
    """TRL-style eager loss (dapo normalisation) on materialised float32 log-softmax: what users run today."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    ratio = torch.exp(logp - old_logp)  # [B, T]
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)  # [B, T]
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])  # [B, T]
    d = ref_logp - logp  # [B, T]
    per_token = per_token + beta * (torch.exp(d) - d - 1)  # [B, T]
    m = mask.float()  # [B, T]
    return (per_token * m).sum() / m.sum().clamp(min=1.0)

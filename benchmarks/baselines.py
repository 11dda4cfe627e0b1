"""Baselines the benchmarks compare against (never imported by tests): what users run today.

`naive_loss` is TRL's loss on materialised float32 log-softmax (grpo / dapo normalisation, token or sequence
importance sampling); Liger's two GRPO losses are called with the same options.
"""

from __future__ import annotations

import torch


def naive_logprobs(hidden, weight, targets, mask):
    """log_softmax(hidden @ W.T) gathered at the targets: the eager [N, V] path, [B, T]."""
    logits = (hidden @ weight.T).float()  # [B, T, V]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1) * mask


def naive_loss(
    logits,
    targets,
    advantages,
    old_logp,
    ref_logp,
    mask,
    loss_type="dapo",
    epsilon_high=0.2,
    beta=0.04,
    importance_sampling_level="token",
):
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    m = mask.float()  # [B, T]
    log_ratio = logp - old_logp  # [B, T]
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1 + epsilon_high) * adv)  # [B, T] or [B, 1]
    d = ref_logp - logp
    per_token = per_token + beta * (torch.exp(d) - d - 1)  # [B, T]
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    return (per_token * m).sum() / m.sum().clamp(min=1)


def liger_triton_loss(
    logits,
    targets,
    advantages,
    old_logp,
    ref_logp,
    mask,
    loss_type="dapo",
    epsilon_high=0.2,
    beta=0.04,
    importance_sampling_level="token",
):
    """Liger-Kernel's `triton_grpo_loss` (logits [B, T + 1, V]: it drops the last position itself)."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    padded = torch.cat([logits, logits[:, -1:]], 1)
    loss, _ = triton_grpo_loss(
        padded,
        old_logp,
        ref_logp,
        targets,
        advantages,
        mask.int(),
        temperature=1.0,
        beta=beta,
        eps_low=0.2,
        eps_high=epsilon_high,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        reduce=True,
    )
    return loss


def liger_chunked_loss(
    hidden,
    weight,
    targets,
    advantages,
    old_logp,
    ref_logp,
    mask,
    loss_type="dapo",
    epsilon_high=0.2,
    beta=0.04,
    importance_sampling_level="token",
):
    """Liger-Kernel's `LigerFusedLinearGRPOLoss` (chunked PyTorch; not compiled, which needs a GPU toolchain)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=False,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
    )
    return loss_fn(
        hidden, weight, targets, mask.int(), advantages, ref_per_token_logps=ref_logp, old_per_token_logps=old_logp
    )[0]

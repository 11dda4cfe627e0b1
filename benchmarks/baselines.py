"""Baselines the benchmarks compare against (never imported by tests): what users run today.

`naive_loss` is TRL's loss on materialised float32 log-softmax (grpo / dapo normalisation, token or sequence
importance sampling); Liger's two GRPO losses are called with the same options. `trl_logprobs` and `trl_loss` are
TRL 1.16's fused LM head (`trl.kernels.ChunkedLogProbFunction`, called as `add_fused_lm_head` calls it) and, after
it, `GRPOTrainer._compute_loss`'s algebra on [B, T]; `tests/test_bench_trl_provider.py` holds them to TRL's own
`_compute_loss` and to `fused_linear_grpo_loss`.
"""

from __future__ import annotations

import torch

ENTROPY_ROWS = 128  # rows per chunk of the eager entropy (TRL's `entropy_from_logits` chunk size)


def naive_logprobs(hidden, weight, targets, mask):
    """log_softmax(hidden @ W.T) gathered at the targets, and the entropy beside it: the eager [N, V] path, [B, T]
    each. The entropy (a logged metric, no gradient) is taken from the same log-softmax in chunks of rows."""
    logits = (hidden @ weight.T).float()  # [B, T, V]
    log_probs = torch.log_softmax(logits, -1)  # [B, T, V]
    logp = log_probs.gather(-1, targets[..., None]).squeeze(-1) * mask  # [B, T]
    return logp, _entropy_of_log_probs(log_probs.detach()) * mask  # [B, T] each


def naive_entropy(logits):
    """Entropy of softmax(logits) per row, no gradient, in chunks of rows as TRL's eager path took it: [B, T]."""
    with torch.no_grad():
        return torch.cat(
            [_entropy_of_log_probs(torch.log_softmax(c.float(), -1)) for c in logits.flatten(0, -2).split(ENTROPY_ROWS)]
        ).view(logits.shape[:-1])


def _entropy_of_log_probs(log_probs):
    rows = log_probs.flatten(0, -2)  # [N, V]
    return torch.cat([-(c.exp() * c).sum(-1) for c in rows.split(ENTROPY_ROWS)]).view(log_probs.shape[:-1])


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


def trl_logprobs(hidden, weight, targets, mask, outputs=("log_probs", "entropy")):
    """TRL 1.16's fused LM head, as `trl.trainer.utils.add_fused_lm_head` runs it in `GRPOTrainer`: per-token
    log-probs and entropy of hidden @ W.T in [4096-token, 32768-vocabulary] tiles, the backward recomputing each
    tile (4 GEMMs). With Triton (CUDA) only the kept tokens go in; elsewhere (CPU) TRL scores every position and
    zeroes the masked ones after, so the provider does too. hidden [B, T, H], weight [V, H] -> logp, entropy [B, T]."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction, _use_triton
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    compact = _use_triton(hidden.device)
    rows = hidden[mask] if compact else hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    per_token = ChunkedLogProbFunction.apply(
        rows,
        weight,
        None,
        targets[mask] if compact else targets.reshape(-1),
        1.0,
        _CHUNKED_LOGPROB_CHUNK_SIZE,
        None,
        1.0,
        outputs,
    )
    logp, entropy = per_token[:2]
    if compact:
        return tuple(None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in (logp, entropy))
    return tuple(None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in (logp, entropy))


def trl_grpo_algebra(
    logp,
    advantages,
    old_logp,
    ref_logp,
    mask,
    loss_type="dapo",
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    beta=0.04,
    importance_sampling_level="token",
    use_bias_correction_kl=True,
    num_items_in_batch=None,
    max_completion_length=None,
):
    """`GRPOTrainer._compute_loss` (TRL 1.16) from the per-token log-probs on: the clipped loss types (grpo, bnpo,
    dr_grpo, dapo, luspo), token or sequence importance sampling, `delta`, k3 KL with `use_bias_correction_kl`, one
    process, no gradient accumulation (dapo's normaliser: `num_items_in_batch`, by default mask.sum()). [B, T] in."""
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        raise ValueError(f"loss_type must be one of TRL's clipped types, got {loss_type!r}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.float()  # [B, T]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [B, 1]
    log_ratio = logp - old_logp  # [B, T]
    if importance_sampling_level == "sequence":
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    else:
        log_importance_weights = log_ratio  # [B, T]
    coef_1 = torch.exp(log_importance_weights)  # [B, T] or [B, 1]
    if beta != 0.0:
        per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # [B, T]
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1  # [B, T]
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)  # [B, T] or [B, 1]
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl  # [B, T]
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean()
    normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)


def trl_loss(hidden, weight, targets, advantages, old_logp, ref_logp, mask, **options):
    """TRL 1.16's GRPO loss step: its fused head (log-probs and entropy, as `GRPOTrainer` always asks) and then its
    `_compute_loss` algebra. hidden [B, T, H], weight [V, H]; `options` as `trl_grpo_algebra`'s."""
    logp, _ = trl_logprobs(hidden, weight, targets, mask)
    return trl_grpo_algebra(logp, advantages, old_logp, ref_logp, mask, **options)

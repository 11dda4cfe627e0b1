"""Float64 oracle: the vocabulary pass and every GRPO loss type, written formula by formula.

The tests hold every backend (torch, triton, cuda) to this file, so it is deliberately independent of the code
under test: it imports only torch and the standard library, never anything from `grpo_kernels`, and it writes each
loss from its formula rather than reusing `losses/`. It is slow and obvious on purpose: full `[B, T, V]` logits,
everything in float64, no chunking, no custom autograd.

Semantics are those of TRL's `GRPOTrainer._compute_loss` for one process without gradient accumulation
(`num_processes = 1`, `current_gradient_accumulation_steps = 1`, `steps_per_generation = 1`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

F64 = torch.float64
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = (*CLIPPED_LOSS_TYPES, "cispo", "sapo", "vespo")


def token_logprobs(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` and entropy under softmax(logits / temperature); float64, shape `logits.shape[:-1]`.

    Differentiable w.r.t. `logits` (autograd through the float64 ops). `-inf` logits are allowed: 0 * log 0 = 0.
    """
    z = logits.double() / temperature  # [..., V]
    log_q = torch.log_softmax(z, dim=-1)  # [..., V]   log q_v = z_v - logsumexp_u z_u
    logp = log_q.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]   log q_{target}
    q = log_q.exp()  # [..., V]
    # H = -sum_v q_v log q_v; where q_v = 0 use log q_v := 0 so neither the value nor the gradient sees 0 * -inf.
    safe_log_q = torch.where(q > 0, log_q, torch.zeros_like(log_q))  # [..., V]
    entropy = -(q * safe_log_q).sum(-1)  # [...]
    return logp, entropy


def _pick(cond: Tensor, if_true: float, if_false: float) -> Tensor:
    """Float64 `where(cond, if_true, if_false)` (torch.where with Python scalars would give the default dtype)."""
    return torch.where(cond, torch.tensor(if_true, dtype=F64), torch.tensor(if_false, dtype=F64))


@torch.no_grad()
def _vespo_phi(
    advantages: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    is_ratio: Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> Tensor:
    """VESPO gamma weight phi(w) = e^lambda * w^k * e^(-lambda * w), so phi(1) = 1; w is the sequence IS ratio.

    log w = sum_t clamp(log_ratio_t, -20, 20) * m_t  [+ sum_t clamp(log is_ratio_t, log 1e-8, 20) * m_t;
    TRL also sums padding, where its rollouts put 1],
    then clamped to [log 1e-8, 20]; (k, lambda) = pos values where A >= 0, else neg; lambda >= 1e-4.
    log phi = lambda + k * log w - lambda * w; non-finite phi -> 0. No gradient (a pure scale of grad log pi).
    """
    log_floor = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
    if is_ratio is not None:
        log_is = is_ratio.log().clamp(log_floor, 20.0)  # [B, T], or [B, 1] for one weight per sequence
        log_is = log_is * mask if log_is.shape == mask.shape else log_is
        log_w = log_w + log_is.sum(-1, keepdim=True)  # [B, 1]
    log_w = log_w.clamp(log_floor, 20.0)  # [B, 1]
    k = _pick(advantages >= 0, k_pos, k_neg)  # [B, 1] or [B, T]
    lam = _pick(advantages >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)  # [B, 1] or [B, T]
    log_phi = lam + k * log_w - lam * log_w.exp()  # [B, 1] or [B, T]
    return log_phi.exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _global_mean(x: Tensor, mask: Tensor) -> Tensor:
    """TRL's logged mean: a [B, 1] tensor is one value per sequence (sum / B), else a mask-weighted token mean.

    Except at T = 1, where TRL's shape test cannot tell the two apart and would average padding: token mean there.
    """
    x = x.detach().to(F64)
    if x.shape[1] == 1 and mask.shape[1] > 1:
        return x.sum() / max(x.shape[0], 1)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def grpo_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    is_ratio: Tensor | None = None,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    use_bias_correction_kl: bool = False,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    top_entropy_quantile: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's GRPO loss on `logits [B, T, V]`, all in float64. Returns (0-dim loss, dict of detached 0-dim metrics).

    The metrics always include `entropy`; tests compare only the keys the implementation returned.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("ref_logp is required when beta != 0")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("max_completion_length is required for loss_type='dr_grpo'")
    eps_low = epsilon_low
    eps_high = epsilon_low if epsilon_high is None else epsilon_high

    logp, entropy = token_logprobs(logits, targets, temperature=temperature)  # [B, T], [B, T]
    B, T = logp.shape
    m = torch.ones(B, T, dtype=F64) if mask is None else mask.to(F64)  # [B, T]
    A = advantages.double()
    A = A.unsqueeze(1) if A.dim() == 1 else A  # [B, 1] or [B, T]
    old = logp.detach() if old_logp is None else old_logp.double()  # [B, T]
    is_w = None if is_ratio is None else is_ratio.double()
    is_w = is_w.unsqueeze(1) if is_w is not None and is_w.dim() == 1 else is_w  # [B, T] or [B, 1]

    # Importance weight w = exp(log_w); token: log_w_t = logp_t - old_t; sequence (GSPO): masked mean over t.
    log_ratio = logp - old  # [B, T]
    if importance_sampling_level == "token":
        log_w = log_ratio  # [B, T]
    else:
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    coef_1 = log_w.exp()  # [B, T] or [B, 1]

    # k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, optionally times the (undetached) ratio.
    kl = None
    if beta != 0.0:
        d = ref_logp.double() - logp  # [B, T]
        kl = d.exp() - d - 1.0  # [B, T]
        if use_bias_correction_kl:
            kl = kl * coef_1  # [B, T]

    phi = None
    ratio_for_clip = coef_1  # the ratio the clip metrics look at
    if loss_type in CLIPPED_LOSS_TYPES:
        # PPO clip: -min(w * A, clamp(w, 1 - eps_low, 1 + eps_high) * A); delta caps the unclipped w (INTELLECT-2).
        coef_2 = coef_1.clamp(1.0 - eps_low, 1.0 + eps_high)
        capped = coef_1 if delta is None else coef_1.clamp(max=delta)
        per_token_loss = -torch.min(capped * A, coef_2 * A)
        ratio_for_clip = capped
    elif loss_type == "cispo":
        # CISPO: -sg(min(w, eps_high)) * A * logp
        per_token_loss = -coef_1.clamp(max=eps_high).detach() * A * logp
    elif loss_type == "sapo":
        # SAPO soft gate: -(sigmoid(tau * (w - 1)) * 4 / tau) * A, tau = tau_pos if A > 0 else tau_neg
        tau = _pick(A > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau) * A
    else:
        # VESPO: -phi(w_seq) * A * logp with phi detached; the IS ratio enters phi, not the product below.
        phi = _vespo_phi(A, log_ratio.detach(), m, is_w, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        per_token_loss = -phi * A * logp

    if top_entropy_quantile < 1.0:
        # Keep only tokens whose entropy is >= the (1 - q)-quantile of the valid tokens' entropies.
        ent = entropy.detach()
        valid = m.bool()
        if valid.any():
            threshold = torch.quantile(ent[valid], 1.0 - top_entropy_quantile)
            entropy_mask = ((ent * m) >= threshold) & valid  # [B, T]
        else:
            entropy_mask = torch.zeros(B, T, dtype=torch.bool)
        per_token_loss = per_token_loss * entropy_mask

    if is_w is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * is_w  # vLLM importance-sampling correction
    if kl is not None:
        per_token_loss = per_token_loss + beta * kl
    # per_token_loss is [B, T], or [B, 1] when nothing above broadcast it; it broadcasts against m [B, T].

    masked_sum = per_token_loss * m  # [B, T]
    if loss_type in ("grpo", "sapo"):
        loss = (masked_sum.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()  # mean_b (sum_t L m / sum_t m)
    elif loss_type == "bnpo":
        loss = masked_sum.sum() / m.sum().clamp(min=1.0)  # sum L m / sum m
    elif loss_type == "dr_grpo":
        loss = masked_sum.sum() / (B * max_completion_length)  # sum L m / (B * T_max)
    elif loss_type == "luspo":
        loss = masked_sum.sum(-1).mean()  # mean_b sum_t L m
    else:  # dapo, cispo, vespo: sum L m / max(N, 1), N = num_items_in_batch or sum m
        n_items = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=F64)
        loss = masked_sum.sum() / n_items.clamp(min=1.0)

    metrics = {"entropy": _global_mean(entropy, m), "ratio/mean": _global_mean(coef_1, m)}
    if kl is not None:
        metrics["kl"] = _global_mean(kl, m)
    if loss_type == "cispo":
        high = (coef_1 > eps_high) & (A > 0)
        metrics["clip_ratio/low_mean"] = torch.zeros((), dtype=F64)
        metrics["clip_ratio/high_mean"] = _global_mean(high, m)
        metrics["clip_ratio/region_mean"] = _global_mean(high, m)
        metrics["cispo_clip_ratio"] = _global_mean(high, m)
    else:
        low = (ratio_for_clip < 1.0 - eps_low) & (A < 0)
        high = (ratio_for_clip > 1.0 + eps_high) & (A > 0)
        metrics["clip_ratio/low_mean"] = _global_mean(low, m)
        metrics["clip_ratio/high_mean"] = _global_mean(high, m)
        metrics["clip_ratio/region_mean"] = _global_mean(low | high, m)
    if phi is not None:
        metrics["vespo/phi_seq_mean"] = _global_mean(phi, m)
    return loss, metrics

"""Float64 oracle: the vocabulary pass and every GRPO loss type, written formula by formula.

The tests hold every backend (torch, triton, cuda) to this file, so it is deliberately independent of the code
under test: it imports only torch and the standard library, never anything from `grpo_kernels`, and it writes each
loss from its formula rather than reusing `losses/`. It is slow and obvious on purpose: full `[B, T, V]` logits,
everything in float64, no chunking, no custom autograd.

Semantics are those of TRL's `GRPOTrainer._compute_loss` for one process without gradient accumulation
(`num_processes = 1`, `current_gradient_accumulation_steps = 1`, `steps_per_generation = 1`), extended with verl's
options (kl_estimator, clip_ratio_c, cispo_two_sided, loss_agg_mode, dro_beta), the loss types gpg, gspo_token,
gmpo, tic_grpo, clip_cov, kl_cov, dppo_tv, dppo_kl and dro, token/sequence weights and per-sequence losses, as the
project's semantics contract defines them. clip_cov draws its tokens with torch.randperm on the default generator,
as verl does: seed torch before each call to compare two implementations.

It deviates from TRL only at numerical extremes, at padding and at T = 1:
- log importance ratios are clamped to [-20, 20] before exp (verl's clamp): per token, and after the masked mean
  or sum for sequence ratios (GSPO, gspo_token, tic_grpo, gmpo); k3's d = ref - logp is clamped to [-20, 20]
  likewise. No gradient flows outside a clamp.
- vespo's per-token IS ratio is masked at padding (TRL sums it there, where its rollouts put 1).
- at T = 1 a per-sequence metric is taken as a token mean (TRL's shape test cannot tell the two apart).
- the entropy bonus divides by the kept-token count for every loss type (TRL: dapo/cispo/vespo by
  num_items_in_batch, which is that count unless given).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

F64 = torch.float64
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "gspo_token", "tic_grpo")  # PPO clip surrogate
SEQUENCE_MEAN_TYPES = ("grpo", "sapo", "gspo_token", "tic_grpo", "gmpo")  # each sequence's token mean, mean over B
LOSS_TYPES = (
    *CLIPPED_LOSS_TYPES,
    "cispo",
    "sapo",
    "vespo",
    "gpg",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "dro",
)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_CLAMP = 20.0  # |log ratio| and |ref - logp| bound (verl)


def sampler_support(z: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """The tokens a truncated sampler keeps, bool `[..., V]`, from the logits `z` it samples from (already divided
    by the temperature), in vLLM's order: min-p on the whole distribution, then top-k, then top-p on what is left.

    - min-p keeps v where q_v >= min_p * max_u q_u (q = softmax(z));
    - top-k keeps v where z_v is at least the k-th largest kept logit (ties at the k-th value all kept);
    - top-p walks the kept tokens from the largest logit down and keeps each one whose predecessors' mass (of the
      kept tokens' renormalised distribution) is below top_p; every token tied with the last one kept is kept too.
    Off: top_k 0 (or >= V), top_p 1.0, min_p 0.0. A `-inf` logit is never kept; a row of them keeps nothing.
    Ties are the one place this can differ from a sampler, which splits tokens tied at the top-p cut by its sort.
    """
    z = z.double()
    keep = z > -math.inf  # [..., V]
    if min_p > 0.0:
        q = torch.softmax(z, dim=-1)  # [..., V]
        keep &= q >= min_p * q.amax(dim=-1, keepdim=True)
    if 0 < top_k < z.shape[-1]:
        kth = z.masked_fill(~keep, -math.inf).topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        keep &= z >= kth
    if top_p < 1.0:
        kept_z = z.masked_fill(~keep, -math.inf)  # [..., V]
        values, _ = kept_z.sort(dim=-1, descending=True)  # [..., V]
        q = torch.softmax(values, dim=-1).nan_to_num(0.0)  # [..., V]; a row of -inf: nothing kept
        before = q.cumsum(dim=-1) - q  # [..., V]: the mass of the tokens ahead of each
        cut = values.masked_fill(~(before < top_p), math.inf).amin(dim=-1, keepdim=True)  # [..., 1] last kept
        keep &= kept_z >= cut
    return keep


def transformed_logits(
    logits: Tensor, temperature: float = 1.0, logit_scale: float = 1.0, final_logit_softcapping: float | None = None
) -> Tensor:
    """float64 z = logit_scale * logits, then c * tanh(z / c) with c = final_logit_softcapping when set, then z / T."""
    z = logits.double() * logit_scale  # [..., V]
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)  # [..., V]
    return z / temperature  # [..., V]


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` and entropy under softmax(z / temperature); float64, shape `logits.shape[:-1]`.

    z = logit_scale * logits, then c * tanh(z / c) with c = final_logit_softcapping when set (TRL's order).
    Differentiable w.r.t. `logits` (autograd through the float64 ops). `-inf` logits are allowed: 0 * log 0 = 0.

    `support` (bool `[..., V]`, e.g. `sampler_support`): the distribution renormalised over those tokens (the
    target counted in it, as the engine counts a target the trainer's own rule would have cut), with the support
    held fixed: the gradient is onehot - q_support inside it and 0 outside.
    """
    z = transformed_logits(logits, temperature, logit_scale, final_logit_softcapping)  # [..., V]
    if support is not None:
        target_hot = torch.nn.functional.one_hot(targets.long(), z.shape[-1]).bool()  # [..., V]
        z = z.masked_fill(~(support | target_hot), -math.inf)
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


def _sequence_fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's fraction of flagged kept tokens, [B'] over the sequences with one (one flag per sequence when
    flags are [B, 1]); [0.] when there is none."""
    if flags.shape[1] == 1 and mask.shape[1] > 1:
        return flags[:, 0].to(F64)
    counts = mask.sum(-1)  # [B]
    fractions = [(flags[b].to(F64) * mask[b]).sum() / counts[b] for b in range(mask.shape[0]) if counts[b] > 0]
    return torch.stack(fractions) if fractions else torch.zeros(1, dtype=F64)


def _global_mean(x: Tensor, mask: Tensor) -> Tensor:
    """TRL's logged mean: a [B, 1] tensor is one value per sequence (sum / B), else a mask-weighted token mean.

    Except at T = 1, where TRL's shape test cannot tell the two apart and would average padding: token mean there.
    """
    x = x.detach().to(F64)
    if x.shape[1] == 1 and mask.shape[1] > 1:
        return x.sum() / max(x.shape[0], 1)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) at the sampled token (Schulman 2020; verl's kl_penalty_forward). [B, T]

    k1 = logp - ref;  k2 = (logp - ref)^2 / 2;  k3 = e^d - d - 1 with d = clamp(ref - logp, -20, 20);
    low_var_kl = clamp(k3, -10, 10);  abs = |logp - ref|.
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "abs":
        return (logp - ref_logp).abs()
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    d = (ref_logp - logp).clamp(-LOG_CLAMP, LOG_CLAMP)  # [B, T]
    k3 = d.exp() - d - 1.0  # [B, T]
    return k3 if estimator == "k3" else k3.clamp(-10.0, 10.0)


def grpo_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    is_ratio: Tensor | None = None,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    use_bias_correction_kl: bool = True,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: float | None = None,
    sampling_logp: Tensor | None = None,
    kl_estimator: str = "k3",
    clip_ratio_c: float | None = None,
    cispo_two_sided: bool = False,
    entropy_coef: float = 0.0,
    loss_agg_mode: str | None = None,
    num_sequences_in_batch: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    dro_beta: float | None = None,
    token_weights: Tensor | None = None,
    sequence_weights: Tensor | None = None,
    return_sequence_losses: bool = False,
) -> tuple[Tensor, dict[str, Tensor]] | tuple[Tensor, dict[str, Tensor], Tensor]:
    """TRL's GRPO loss on `logits [B, T, V]`, all in float64. Returns (0-dim loss, dict of detached 0-dim metrics),
    and the per-sequence losses [B] (summing to the loss before the entropy bonus) when `return_sequence_losses`.

    The metrics always include `entropy`; tests compare only the keys the implementation returned.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if loss_type in ("gspo_token", "tic_grpo") and importance_sampling_level != "token":
        raise ValueError(f"loss_type={loss_type!r} needs importance_sampling_level='token'")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if loss_agg_mode is not None and loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be None or one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if clip_ratio_c is not None and not clip_ratio_c > (0.0 if loss_type in ("dppo_tv", "dppo_kl") else 1.0):
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip) or > 0 (DPPO's IS cap), got {clip_ratio_c}")
    if loss_type == "dro" and not (dro_beta is not None and dro_beta > 0):
        raise ValueError(f"loss_type='dro' needs dro_beta > 0, got {dro_beta}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("ref_logp is required when beta != 0")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("max_completion_length is required for loss_type='dr_grpo'")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high

    logp, entropy = token_logprobs(
        logits,
        targets,
        temperature=temperature,
        logit_scale=logit_scale,
        final_logit_softcapping=final_logit_softcapping,
    )  # [B, T], [B, T]
    B, T = logp.shape
    m = torch.ones(B, T, dtype=F64) if mask is None else mask.to(F64)  # [B, T]
    n = m.sum(-1, keepdim=True)  # [B, 1]   kept tokens per sequence
    A = advantages.double()
    A = A.unsqueeze(1) if A.dim() == 1 else A  # [B, 1] or [B, T]
    old = logp.detach() if old_logp is None else old_logp.double()  # [B, T]
    is_w = None if is_ratio is None else is_ratio.double()
    is_w = is_w.unsqueeze(1) if is_w is not None and is_w.dim() == 1 else is_w  # [B, T] or [B, 1]

    # Importance weight w = exp(clamp(log_w, -20, 20)); token: log_w_t = logp_t - old_t; sequence (GSPO): masked mean.
    log_ratio = logp - old  # [B, T]
    seq_log_ratio = (log_ratio * m).sum(-1, keepdim=True) / n.clamp(min=1.0)  # [B, 1]
    log_w = log_ratio if importance_sampling_level == "token" else seq_log_ratio  # [B, T] or [B, 1]
    coef_1 = log_w.clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # [B, T] or [B, 1]

    # KL(pi || ref) estimate, optionally times the (undetached) ratio.
    kl = None
    if beta != 0.0:
        kl = _kl_estimate(logp, ref_logp.double(), kl_estimator)  # [B, T]
        if use_bias_correction_kl:
            kl = kl * coef_1  # [B, T]

    phi = None
    dual_clipped = truncated = None
    ratio_for_clip = coef_1  # the ratio the trust-region clip metrics look at
    ratio_logged = coef_1  # the ratio of the "ratio/mean" metric
    if loss_type in CLIPPED_LOSS_TYPES:
        if loss_type == "gspo_token":
            # GSPO-token: s_t = sg(s) * pi_t / sg(pi_t): the value of GSPO's sequence ratio s, a gradient per token.
            ratio = (seq_log_ratio.detach() + logp - logp.detach()).clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # [B, T]
        elif loss_type == "tic_grpo":
            # TIC-GRPO: the trajectory ratio prod_t w_t (not length-normalised), one per sequence.
            ratio = (log_ratio * m).sum(-1, keepdim=True).clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # [B, 1]
        else:
            ratio = coef_1
        # PPO clip: -min(w * A, clamp(w, 1 - eps_low, 1 + eps_high) * A); delta caps the unclipped w (INTELLECT-2).
        coef_2 = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        capped = ratio if delta is None else ratio.clamp(max=delta)
        per_token_loss = -torch.min(capped * A, coef_2 * A)
        if clip_ratio_c is not None:
            # Dual clip (arXiv:1912.09729): where A < 0 the loss is also capped at -A * c.
            dual_clipped = (A < 0) & (per_token_loss > -A * clip_ratio_c)
            per_token_loss = torch.where(A < 0, torch.min(per_token_loss, -A * clip_ratio_c), per_token_loss)
        ratio_for_clip, ratio_logged = capped, ratio
    elif loss_type == "cispo":
        # CISPO: -sg(min(w, eps_high)) * A * logp; two-sided: -sg(clamp(w, 1 - eps_low, 1 + eps_high)) * A * logp
        weight = coef_1.clamp(1.0 - eps_low, 1.0 + eps_high) if cispo_two_sided else coef_1.clamp(max=eps_high)
        per_token_loss = -weight.detach() * A * logp
    elif loss_type == "sapo":
        # SAPO soft gate: -(sigmoid(tau * (w - 1)) * 4 / tau) * A, tau = tau_pos if A > 0 else tau_neg
        tau = _pick(A > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau) * A
    elif loss_type == "vespo":
        # VESPO: -phi(w_seq) * A * logp with phi detached; the IS ratio enters phi, not the product below.
        phi = _vespo_phi(A, log_ratio.detach(), m, is_w, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        per_token_loss = -phi * A * logp
    elif loss_type == "gpg":
        # GPG: plain policy gradient -A * logp, no ratio, no clip.
        per_token_loss = -A * logp
    elif loss_type in ("clip_cov", "kl_cov"):
        # Clip-Cov / KL-Cov (arXiv:2505.22617; verl). Over the N kept tokens of the batch, in row-major order,
        # cov = (A - mean A) * (logp - mean logp) (detached). clip_cov: the PPO clip surrogate, set to 0 at
        # n = max(floor(clip_cov_ratio * N), 1) tokens drawn (torch.randperm(K)[:n], verl's draw, when K > 0) from the
        # K tokens the clip leaves alone with lb < cov < ub. kl_cov: -w * A (no clip), plus
        # ppo_kl_coef * |logp - old| at the k = max(floor(kl_cov_ratio * N), 1) tokens of largest cov (torch.topk).
        kept = m.bool()  # [B, T]
        positions = kept.nonzero()  # [N, 2]
        a = A.expand(B, T)[kept]  # [N]
        lp = logp.detach()[kept]  # [N]
        cov = (a - a.mean()) * (lp - lp.mean())  # [N]
        chosen = torch.zeros(B, T, dtype=torch.bool)
        if loss_type == "clip_cov":
            unclipped, clipped = -coef_1 * A, -coef_1.clamp(1.0 - eps_low, 1.0 + eps_high) * A
            by_clip = (clipped > unclipped).expand(B, T)[kept]  # [N]
            candidates = (~by_clip & (cov > clip_cov_lb) & (cov < clip_cov_ub)).nonzero().squeeze(-1)  # [K]
            if len(candidates) > 0:
                pick = candidates[torch.randperm(len(candidates))[: max(int(clip_cov_ratio * len(a)), 1)]]
                chosen[positions[pick, 0], positions[pick, 1]] = True
            per_token_loss = torch.where(chosen, 0.0, torch.max(unclipped, clipped).expand(B, T))  # [B, T]
        else:
            if len(a) > 0:
                pick = torch.topk(cov, max(int(kl_cov_ratio * len(a)), 1)).indices
                chosen[positions[pick, 0], positions[pick, 1]] = True
            per_token_loss = -coef_1 * A + ppo_kl_coef * (logp - old).abs() * chosen  # [B, T]
    elif loss_type in ("dppo_tv", "dppo_kl"):
        # DPPO (arXiv:2602.04879; verl's form): -sg(min(w, c)) * A * logp, zeroed where the token's probability left
        # the trust region on the side A pushes it (A > 0: up, else down). p = e^logp, q = e^old.
        # TV: p - q <= eps_high (A > 0), p - q >= -eps_low (A <= 0).
        # KL: d = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)), the binary KL; inside when
        #     d <= eps_high or p <= q (A > 0), d <= eps_low or p >= q (A <= 0).
        p, q = logp.detach().exp(), old.exp()  # [B, T]
        if loss_type == "dppo_tv":
            up_ok, down_ok = p - q <= eps_high, p - q >= -eps_low
        else:
            d = q * (old - logp.detach()) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))  # [B, T]
            up_ok, down_ok = (d <= eps_high) | (p <= q), (d <= eps_low) | (p >= q)
        inside = torch.where(A > 0, up_ok, down_ok)  # [B, T]
        w = coef_1 if clip_ratio_c is None else coef_1.clamp(max=clip_ratio_c)
        per_token_loss = -A * w.detach() * logp * inside.to(F64)  # [B, T]
        dppo_low, dppo_high = ~inside & ~(A > 0), ~inside & (A > 0)
        if clip_ratio_c is not None:
            truncated = (coef_1 > clip_ratio_c) & inside  # [B, T]
    elif loss_type == "dro":
        # DRO (arXiv:2405.19107; verl's form): -(A * logp - beta/2 * (logp - old)^2), the log-ratio not clamped.
        per_token_loss = -(A * logp - 0.5 * dro_beta * (logp - old) ** 2)  # [B, T]
    else:
        # GMPO: L_i = -mean_t(A) * exp(mean_t(lr_min)); the token log-ratio lr is clipped to [-eps_low, eps_high] in
        # log space, on the side the sign of A selects: lr_min = sign(A) * min(sign(A) * lr, sign(A) * lr_c).
        # Means divide by max(sum_t m, 1) (verl: sum_t m + 1e-8, the same for non-empty rows); the mean log-ratio
        # gets the uniform +-20 clamp.
        sign = A.expand(B, T).sign()  # [B, T]
        lr_c = log_ratio.clamp(-eps_low, eps_high)  # [B, T]
        lr_min = sign * torch.min(sign * log_ratio, sign * lr_c)  # [B, T]
        ratio = ((lr_min * m).sum(-1, keepdim=True) / n.clamp(min=1.0)).clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # [B, 1]
        A_seq = (A.expand(B, T) * m).sum(-1, keepdim=True) / n.clamp(min=1.0)  # [B, 1]
        per_token_loss = -A_seq * ratio  # [B, 1]
        if is_w is not None:
            # verl geo_mean's rollout IS weight: the geometric mean exp(mean_t log(w_t + 1e-10)) over kept tokens.
            log_is = (is_w + 1e-10).log().expand(B, T)  # [B, T]
            per_token_loss = per_token_loss * ((log_is * m).sum(-1, keepdim=True) / n.clamp(min=1.0)).exp()
        ratio_logged = ratio

    if off_policy_mask_threshold is not None:
        # DeepSeek-V3.2 off-policy sequence mask (TRL): drop a sequence when A < 0 and its mean over kept tokens of
        # log pi_sampler - log pi_theta exceeds the threshold; the sampler is sampling_logp, else old_logp.
        sampler = old if sampling_logp is None else sampling_logp.double()
        mean_kl = (torch.nan_to_num(sampler - logp.detach(), nan=0.0) * m).sum(-1, keepdim=True) / n.clamp(min=1.0)
        per_token_loss = per_token_loss * ((A >= 0) | (mean_kl <= off_policy_mask_threshold)).to(F64)

    m_eff = m  # the kept tokens, for the entropy bonus
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
        m_eff = m * entropy_mask  # [B, T]

    if is_w is not None and loss_type not in ("vespo", "gmpo"):
        per_token_loss = per_token_loss * is_w  # vLLM importance-sampling correction
    if kl is not None:
        per_token_loss = per_token_loss + beta * kl
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.double()  # [B, T]
    if sequence_weights is not None:
        per_token_loss = per_token_loss * sequence_weights.double().unsqueeze(-1)  # [B, T] or [B, 1]
    # per_token_loss is [B, T], or [B, 1] when nothing above broadcast it; it broadcasts against m [B, T].

    # loss = sum_i seq_losses_i, seq_losses_i = (sum_t L m) / Z_i with Z_i the normaliser's share for sequence i.
    row = (per_token_loss * m).sum(-1)  # [B]   sum_t L m
    n_seq = n.squeeze(-1)  # [B]
    # a given count is used as it is (a fraction too, as TRL's rescaled one); the batch's own is at least 1
    n_items = m.sum().clamp(min=1.0) if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=F64)
    n_seqs = (n_seq > 0).sum().to(F64)  # S: the non-empty sequences
    if num_sequences_in_batch is not None:
        n_seqs = torch.as_tensor(num_sequences_in_batch, dtype=F64)
    if loss_agg_mode is None and loss_type in SEQUENCE_MEAN_TYPES:
        seq_losses = row / n_seq.clamp(min=1.0) / B  # mean_b (sum_t L m / sum_t m)
    elif loss_agg_mode is None and loss_type == "bnpo":
        seq_losses = row / m.sum().clamp(min=1.0)  # sum L m / sum m
    elif loss_agg_mode is None and loss_type == "dr_grpo":
        seq_losses = row / (B * max_completion_length)  # sum L m / (B * T_max)
    elif loss_agg_mode is None and loss_type == "luspo":
        seq_losses = row / B  # mean_b sum_t L m
    elif loss_agg_mode in (None, "token-mean"):  # and dapo, cispo, vespo, gpg: sum L m / Z
        seq_losses = row / n_items
    elif loss_agg_mode == "token-sum":
        seq_losses = row  # sum L m
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = row / n_seqs.clamp(min=1.0)  # sum_i (sum_t L m) / max(S, 1)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = row / n_seq.clamp(min=1.0) / n_seqs.clamp(min=1.0)  # sum_i (sum_t L m / sum_t m) / max(S, 1)
    else:  # seq-mean-token-sum-norm
        seq_losses = row / (T if loss_scale_factor is None else loss_scale_factor)  # sum L m / factor
    loss = seq_losses.sum()
    if entropy_coef != 0.0:
        # Entropy bonus: minus coef times the mean entropy of the kept tokens; its gradient reaches the logits.
        loss = loss - entropy_coef * (entropy * m_eff).sum() / m_eff.sum().clamp(min=1.0)

    metrics = {"entropy": _global_mean(entropy, m), "ratio/mean": _global_mean(ratio_logged, m)}
    if kl is not None:
        metrics["kl"] = _global_mean(kl, m)
    if loss_type == "cispo" and cispo_two_sided:
        low = coef_1 < 1.0 - eps_low
        high = coef_1 > 1.0 + eps_high
    elif loss_type == "cispo":
        high = (coef_1 > eps_high) & (A > 0)
        low = torch.zeros_like(high)
    elif loss_type in ("gpg", "kl_cov", "dro"):
        low = high = torch.zeros(B, T, dtype=torch.bool)
    elif loss_type in ("dppo_tv", "dppo_kl"):
        low, high = dppo_low, dppo_high
    elif loss_type == "gmpo":
        clipped = log_ratio != log_ratio.clamp(-eps_low, eps_high)  # [B, T]
        low, high = clipped & (A < 0), clipped & (A > 0)
    else:
        low = (ratio_for_clip < 1.0 - eps_low) & (A < 0)
        high = (ratio_for_clip > 1.0 + eps_high) & (A > 0)
    metrics["clip_ratio/low_mean"] = _global_mean(low, m)
    metrics["clip_ratio/high_mean"] = _global_mean(high, m)
    metrics["clip_ratio/region_mean"] = _global_mean(low | high, m)
    if loss_type in CLIPPED_LOSS_TYPES:
        # TRL's extremes over sequences of each sequence's clipped fraction; empty sequences have none (TRL: NaN)
        metrics["clip_ratio/low_min"] = _sequence_fraction(low, m).min()
        metrics["clip_ratio/high_max"] = _sequence_fraction(high, m).max()
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = metrics["clip_ratio/region_mean"]
    if dual_clipped is not None:
        metrics["clip_ratio/dual_mean"] = _global_mean(dual_clipped, m)
    if truncated is not None:  # DPPO: kept tokens inside the trust region whose IS weight is capped at c
        metrics["clip_ratio/truncated_mean"] = _global_mean(truncated, m)
    if phi is not None:
        metrics["vespo/phi_seq_mean"] = _global_mean(phi, m)
    if loss_type == "clip_cov":  # verl's name: the fraction of kept tokens whose loss was cut
        metrics["pg_clipfrac"] = chosen.sum().to(F64) / m.sum().clamp(min=1.0)
    if loss_type == "kl_cov":  # verl's: the mean |logp - old| (its kl_cov `ppo_kl`)
        metrics["ppo_kl_abs"] = _global_mean((logp - old).abs(), m)
    return (loss, metrics, seq_losses) if return_sequence_losses else (loss, metrics)

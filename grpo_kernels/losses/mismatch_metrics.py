"""The sampler-mismatch metrics, 0-dim tensors (no host read): verl 0.9.1's `compute_offpolicy_metrics`, its IS-weight
and rejection statistics (`rollout_corr_helper`), NeMo RL's four mismatch errors (`loss_functions.py`), and TRL's
sampling_logp_difference (the sampler-sync guard's reading, `trainer/sampler_sync.py`), each under its framework's
name. `losses/mismatch.py` calls them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_kernels.rollout_correction import SAFETY_BOUND, RolloutCorrection

EPS = 1e-8  # verl's and NeMo's guard in a masked mean
SAMPLER_GAP = "sampling_logp_difference"  # TRL's name of the sampler-sync guard's reading (`sampler_gap`)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ of x over the kept tokens (anything at padding, inf or NaN included, counts 0)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """verl's (and NeMo's) masked mean: Σ kept / (count + 1e-8)."""
    count = mask.sum(dtype=x.dtype) if dim is None else mask.sum(dim, dtype=x.dtype)  # no float copy of the mask
    return masked_sum(x, mask, dim) / (count + EPS)


def float32_mean(flags: Tensor, dtype: torch.dtype) -> Tensor:
    """The fraction of True in `flags`, averaged in float32 as verl's `.float().mean()` does, in `dtype`."""
    return flags.float().mean().to(dtype)


def _masked_extremes(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(max, min) of x over the kept tokens (−inf, +inf when there are none)."""
    return x.masked_fill(~mask, -math.inf).amax(), x.masked_fill(~mask, math.inf).amin()


def _threshold_log(value: float) -> Tensor:
    """log of a threshold as verl forms it (a default-dtype tensor), for its comparisons in log space."""
    return torch.log(torch.tensor(value))


def is_metrics(
    weights: Tensor, raw: Tensor, log_weight: Tensor, mask: Tensor, correction: RolloutCorrection
) -> dict[str, Tensor]:
    """verl's IS-weight metrics (`compute_is_metrics`): mean / max / min, the fractions beyond the bounds, std and
    effective sample size of the applied weights, their per-sequence summary, and IcePop's out-of-bounds ratio.
    `weights` / `raw` [B, T]: applied and before the bounds (0 at padding); `log_weight` [B, T] or [B, 1]."""
    dtype = weights.dtype
    upper = math.inf if correction.rollout_is_threshold is None else correction.rollout_is_threshold
    lower = 1.0 / upper if correction.rollout_is_threshold_lower is None else correction.rollout_is_threshold_lower
    m: dict[str, Tensor] = {"rollout_is_mean": masked_mean(weights, mask)}
    if correction.rollout_is == "sequence":  # over every sequence, in log space
        m["rollout_is_max"] = log_weight.amax().clamp(max=SAFETY_BOUND).exp()
        m["rollout_is_min"] = log_weight.amin().exp()
        m["rollout_is_ratio_fraction_high"] = float32_mean(log_weight > _threshold_log(upper), dtype)
        m["rollout_is_ratio_fraction_low"] = float32_mean(log_weight < _threshold_log(lower), dtype)
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(dtype), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(dtype), mask)
        m["rollout_is_max"], m["rollout_is_min"] = _masked_extremes(weights, mask)
    bounded = weights.clamp(min=0.0, max=upper)  # [B, T]
    mean = masked_mean(bounded, mask)
    variance = (masked_mean(bounded.square(), mask) - mean.square()).clamp(min=0.0)
    m["rollout_is_std"] = torch.where(mask.sum() > 1, variance.sqrt(), torch.zeros_like(variance))
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (mean + EPS)).square(), mask)
    per_sequence = masked_mean(weights, mask, -1)  # [B]
    raw_per_sequence = masked_mean(raw, mask, -1)  # [B]
    m["rollout_is_seq_mean"] = per_sequence.mean()
    m["rollout_is_seq_std"] = per_sequence.std() if per_sequence.numel() > 1 else per_sequence.new_zeros(())
    m["rollout_is_seq_max"] = per_sequence.amax()
    m["rollout_is_seq_min"] = per_sequence.amin()
    m["rollout_is_seq_max_deviation"] = (per_sequence - 1.0).abs().amax()
    m["rollout_is_seq_fraction_high"] = float32_mean(raw_per_sequence > upper, dtype)
    m["rollout_is_seq_fraction_low"] = float32_mean(raw_per_sequence < lower, dtype)
    if correction.rollout_is_bounds == "mask" and correction.rollout_is_threshold_lower is not None:
        outside = (raw < correction.rollout_is_threshold_lower) | (raw > upper)
        m["rollout_is_oob_ratio"] = masked_mean(outside.to(dtype), mask)
    return m


def rule_metrics(name: str, statistic: Tensor, keep: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """verl's per-statistic rejection metrics: the statistic's mean, max and min over the kept tokens, and the
    fractions of tokens and of sequences it rejects. `statistic`, `keep`: [B, T] per token, or [B, 1] per sequence
    (a sequence's value counts once per kept token; taken at [B], weighted by the sequences' token counts)."""
    dtype = statistic.dtype
    valid = mask.any(-1)  # [B]
    prefix = f"rollout_rs_{name}"
    if statistic.shape[-1] == 1:  # per sequence: its token count weighs it
        tokens = mask.sum(-1, dtype=dtype)  # [B]
        value, rejected = statistic[:, 0], ~keep[:, 0]  # [B]
        total = tokens.sum() + EPS
        peak, floor = _masked_extremes(value, valid)
        mean = masked_sum(value * tokens, valid) / total
        token_fraction = (rejected.to(dtype) * tokens).sum() / total
        sequence_rejected = rejected & valid  # [B]
    else:
        peak, floor = _masked_extremes(statistic, mask)
        mean = masked_mean(statistic, mask)
        token_fraction = masked_mean((~keep).to(dtype), mask)
        sequence_rejected = (~keep & mask).any(-1)  # [B]
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_max": peak,
        f"{prefix}_min": floor,
        f"{prefix}_masked_fraction": token_fraction,
        f"{prefix}_seq_masked_fraction": sequence_rejected.to(dtype).sum() / valid.to(dtype).sum().clamp(min=1.0),
    }


def sampler_gap(train_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The sampler-sync guard's reading, TRL's `sampling_logp_difference`: the mean and the max of
    |log π_train − log π_sampler| over the tokens of `mask` [B, T], a token the sampler could not score (NaN) left
    out; 0 and 0 where no token is kept. 0-dim tensors, no host read."""
    gap = (train_logp - sampling_logp).abs()  # [B, T]
    kept = mask.bool() & ~torch.isnan(gap)  # [B, T]
    mean = masked_sum(gap, kept) / kept.sum().clamp(min=1).to(gap.dtype)
    largest = gap.masked_fill(~kept, 0.0).amax() if gap.numel() else gap.new_zeros(())
    return mean, largest


def offpolicy_metrics(train_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """verl's `compute_offpolicy_metrics` (kl, k3_kl, training / rollout perplexity, log_ppl_diff and its extremes,
    ppl_ratio, chi2_token, chi2_seq), NeMo RL's token_mult_prob_error, gen_kl_error, policy_kl_error and
    js_divergence_error, and TRL's sampling_logp_difference mean and max (`sampler_gap`, what the sampler-sync guard
    reads), of π_train against the sampler on the tokens of `mask` [B, T]."""
    log_ratio = train_logp - sampling_logp  # [B, T]
    gap_mean, gap_max = sampler_gap(train_logp, sampling_logp, mask)
    train_mean = masked_mean(train_logp, mask, -1)  # [B]
    sampling_mean = masked_mean(sampling_logp, mask, -1)  # [B]
    log_ppl_diff = sampling_mean - train_mean  # [B]
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
    sequence_log_ratio = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B]
    mixture = torch.log(0.5 * train_logp.exp() + 0.5 * sampling_logp.exp())  # [B, T]: log of (π_train + π_μ) / 2
    to_mixture = lambda lp: (lp - mixture).exp() - (lp - mixture) - 1.0  # noqa: E731  k3 KL(p ‖ M) per token
    return {
        "training_ppl": (-train_mean).exp().mean(),
        "training_log_ppl": (-train_mean).mean(),
        "kl": masked_mean(sampling_logp - train_logp, mask),
        "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1.0, mask),
        "rollout_ppl": (-sampling_mean).exp().mean(),
        "rollout_log_ppl": (-sampling_mean).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.amax(),
        "log_ppl_diff_min": log_ppl_diff.amin(),
        "ppl_ratio": log_ppl_diff.exp().mean(),
        "chi2_token": masked_mean(safe.exp().square(), mask) - 1.0,
        "chi2_seq": (2.0 * sequence_log_ratio).exp().mean() - 1.0,
        "token_mult_prob_error": masked_mean(log_ratio.abs().exp(), mask),
        "gen_kl_error": masked_mean(log_ratio.exp() - 1.0 - log_ratio, mask),
        "policy_kl_error": masked_mean((-log_ratio).exp() - 1.0 + log_ratio, mask),
        "js_divergence_error": masked_mean(0.5 * to_mixture(train_logp) + 0.5 * to_mixture(sampling_logp), mask),
        f"{SAMPLER_GAP}_mean": gap_mean,
        f"{SAMPLER_GAP}_max": gap_max,
    }

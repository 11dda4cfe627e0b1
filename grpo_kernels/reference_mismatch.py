"""float64 oracle of the sampler-mismatch corrections of NeMo RL and prime-rl, transcribed formula by formula from
their sources (neither installs here), independent of `losses/`; `tests/test_mismatch.py` holds the rollout
correction to it. verl's own code is the oracle of verl's corrections (`tests/test_mismatch_verl.py`).

Sources: NeMo RL `nemo_rl/algorithms/loss/loss_functions.py` at commit 7ea279ab (ClippedPGLossFn.__call__) and
`nemo_rl/algorithms/utils.py` (`calculate_kl`, `masked_mean`); prime-rl `src/prime_rl/trainer/rl/loss.py` at commit
559b4477 (`ipo_loss_fn`, `compute_importance_ratio_and_mismatch_kl`). Where NeMo zeroes a non-finite IS weight
(`nan_to_num`), this project clamps the log-ratio at ±20 instead: the oracle is for finite inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def nemo_masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """NeMo's `masked_mean` (utils.py:212-224): Σ(values·mask) / (Σ mask + 1e-8)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    return total / (count + 1e-8)


def nemo_k3(logprobs: Tensor, logprobs_reference: Tensor) -> Tensor:
    """NeMo's `calculate_kl(kl_type="k3")` without clamps (utils.py:42-95): logr = ref − logprobs, e^logr − 1 − logr."""
    logr = logprobs_reference - logprobs
    return torch.exp(logr) - 1 - logr


def nemo_mismatch_metrics(prev: Tensor, gen: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """NeMo's four train–generation mismatch metrics (loss_functions.py:404-466), `prev` π_train, `gen` the
    generator's, `mask` float [B, T]."""
    mult_prob_error = nemo_masked_mean(torch.exp(torch.abs(gen - prev) * mask), mask)  # :406-412
    gen_kl_error = nemo_masked_mean(nemo_k3(gen, prev), mask)  # :414-427, kl(P_gen || P_train)
    policy_kl_error = nemo_masked_mean(nemo_k3(prev, gen), mask)  # :429-442, kl(P_train || P_gen)
    log_mixture = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))  # :447-449
    kl_prev = torch.exp(prev - log_mixture) - (prev - log_mixture) - 1  # :451-453
    kl_gen = torch.exp(gen - log_mixture) - (gen - log_mixture) - 1  # :456-460
    js = nemo_masked_mean(0.5 * kl_prev + 0.5 * kl_gen, mask)  # :462-466
    return {
        "token_mult_prob_error": mult_prob_error,
        "gen_kl_error": gen_kl_error,
        "policy_kl_error": policy_kl_error,
        "js_divergence_error": js,
    }


def nemo_importance_weights(
    prev: Tensor, gen: Tensor, mask: Tensor, kind: str, ratio: float, ratio_min: float | None, sequence: bool = False
) -> Tensor:
    """NeMo's off-policy IS weights (loss_functions.py:566-665): token or sequence level (`sequence`), then "tis"
    (clamp to [min or 0, max]), "icepop" (0 outside [min, max]) or "seq-mask-tis" (token weights, 0 for sequences
    whose geometric-mean ratio leaves [min, max]); `mask` float [B, T]."""
    if sequence:  # :568-577
        weights = torch.exp(((prev - gen) * mask).sum(dim=-1)).unsqueeze(-1)
    else:  # :578-584
        weights = torch.exp(prev - gen)
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
    if kind == "tis":  # :597-616
        return torch.clamp(weights, min=0.0 if ratio_min is None else ratio_min, max=ratio).expand_as(prev)
    if kind == "icepop":  # :617-636
        kept = (weights >= ratio_min) & (weights <= ratio)
        return torch.where(kept, weights, torch.zeros_like(weights)).expand_as(prev)
    log_ratio = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)  # seq-mask-tis, :637-665
    geo = torch.exp(nemo_masked_mean(log_ratio, mask, dim=-1))
    kept = ((geo >= ratio_min) & (geo <= ratio)).to(prev.dtype)
    return weights * kept.unsqueeze(-1)


def nemo_token_loss(
    curr: Tensor, prev: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor, epsilon: float
) -> Tensor:
    """NeMo's token-level clipped PG loss with IS weights (loss_functions.py:526-552, 678-683):
    masked_mean(w · max(−A·r, −A·clip(r, 1 ± ε)), mask), r = exp(curr − prev)."""
    ratios = torch.exp(curr - prev)
    clamped = ratios.clamp(1.0 - epsilon, 1.0 + epsilon)
    clip_loss = torch.max(-advantages * ratios, -advantages * clamped)
    return nemo_masked_mean(weights * clip_loss, mask)


def prime_ipo_loss(
    trainer: Tensor, inference: Tensor, advantages: Tensor, loss_mask: Tensor, threshold: float, kl_tau: float
) -> tuple[Tensor, Tensor]:
    """prime-rl's IPO loss (loss.py:100-105, 164-196), summed over the tokens and divided by their count (its
    `rl_scale`, the trainable tokens): the loss and the `is_masked` metric. `loss_mask` bool [B, T]."""
    log_ratio = trainer - inference  # :103
    ratio = torch.exp(log_ratio)  # :104
    is_masked = torch.abs(torch.exp(trainer) - torch.exp(inference)) > threshold  # :177-179
    keep = loss_mask & ~is_masked  # :180
    pg_loss = keep * advantages * ratio  # :183 (adv_tau = 1)
    kl_loss = loss_mask * log_ratio**2  # :184
    per_token = -pg_loss + kl_tau * kl_loss  # :185
    count = loss_mask.sum()
    return per_token.sum() / count, (is_masked[loss_mask].sum() / count.clamp(min=1)).to(trainer.dtype)

"""KL penalty estimators of KL(π_θ ‖ π_ref), evaluated at the sampled token.

Schulman, "Approximating KL divergence" (2020): with d = ref − logp, k1 = −d, k2 = d²/2, k3 = e^d − d − 1;
verl adds `low_var_kl` (k3 clamped) and `abs` = |d|.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_kernels.losses.terms import LOG_RATIO_CLAMP, TokenTerms
from grpo_kernels.options import LossOptions


def k1(terms: TokenTerms) -> Tensor:
    """logp − ref: unbiased, high variance, can be negative, [B, T]."""
    return terms.logp - terms.ref_logp


def k2(terms: TokenTerms) -> Tensor:
    """(logp − ref)²/2: biased, low variance; its gradient is the true KL's, [B, T]."""
    return 0.5 * (terms.logp - terms.ref_logp).square()


def k3(terms: TokenTerms) -> Tensor:
    """e^d − d − 1 ≥ 0 with d = ref − logp: unbiased and low variance (TRL's; DeepSeekMath eq. 4), [B, T].

    Written as expm1(d) − d, which keeps the low bits when the policies nearly agree. d is clamped to
    ±LOG_RATIO_CLAMP, so e^d never overflows (acts only where |ref − logp| > 20; gradient 0 beyond).
    """
    d = (terms.ref_logp - terms.logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    return torch.expm1(d) - d


def low_var_kl(terms: TokenTerms) -> Tensor:
    """verl's `low_var_kl`: k3 clamped to [−10, 10], [B, T]."""
    return k3(terms).clamp(-10.0, 10.0)


def abs_kl(terms: TokenTerms) -> Tensor:
    """verl's `abs`: |logp − ref|, biased, non-negative; gradient sign(logp − ref) (0 where they agree), [B, T]."""
    return (terms.logp - terms.ref_logp).abs()


KL_ESTIMATORS: dict[str, Callable[[TokenTerms], Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "low_var_kl": low_var_kl,
    "abs": abs_kl,
}


def kl_penalty(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Per-token KL term before β; times the unclipped IS ratio under `use_bias_correction_kl` (DeepSeek-V3.2)."""
    kl = KL_ESTIMATORS[options.kl_estimator](terms)  # [B, T]
    return kl * terms.ratio if options.use_bias_correction_kl else kl

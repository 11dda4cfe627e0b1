"""KL penalty estimators, evaluated at the sampled token (Schulman, "Approximating KL divergence", 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.losses.terms import TokenTerms
from grpo_kernels.options import LossOptions


def k3(terms: TokenTerms) -> Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref): e^(ref − logp) − (ref − logp) − 1 ≥ 0, [B, T] (TRL's, DeepSeekMath eq. 4).

    Written as expm1(d) − d: for nearly equal policies e^d − 1 cancels, and expm1 keeps its low bits.
    """
    delta = terms.ref_logp - terms.logp  # [B, T]
    return torch.expm1(delta) - delta


def kl_penalty(terms: TokenTerms, options: LossOptions) -> Tensor:
    """Per-token KL term before β; times the unclipped IS ratio under `use_bias_correction_kl` (DeepSeek-V3.2)."""
    kl = k3(terms)  # [B, T]
    return kl * terms.ratio if options.use_bias_correction_kl else kl

"""Token-level GRPO losses formed right after the PyTorch vocabulary pass: each kept token's weighted loss and its
derivative dL/dlogp in closed form, so that the backward is the vocabulary pass's alone, with no autograd graph of
the loss algebra to build in the forward and to walk in the backward.

The same transcription of `grpo_kernels/losses/` (policy.py, kl.py) as the Triton epilogue (`triton/grpo_loss.py`),
in whole-tensor ops; those PyTorch functions stay the specification, and the tests hold this one to the float64
oracle. Where the specification's autograd takes a derivative through clamp, min or where, this takes the same one:
clamp passes the gradient inside its bounds (inclusive), and a tie of min splits it in half.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_kernels.kernels.protocol import EPILOGUE_KL, LossSides, VocabPassArgs
from grpo_kernels.kernels.torch.token_logprobs import token_logprobs_fwd

KL_KINDS = EPILOGUE_KL  # the estimators `_kl` implements
LOG_RATIO_CLAMP = 20.0  # as losses/terms.py
LOW_VAR_KL_CLAMP = 10.0  # as losses/kl.py


def _ratio(logp: Tensor, old_logp: Tensor | None) -> tuple[Tensor, Tensor]:
    """ρ = exp(clamp(logp − old, ±20)) and dρ/dlogp (ρ inside the clamp, 0 outside); on-policy ρ = 1, dρ = 1."""
    if old_logp is None:
        ones = torch.ones_like(logp)
        return ones, ones
    log_ratio = logp - old_logp
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return ratio, ratio.masked_fill(log_ratio.abs() > LOG_RATIO_CLAMP, 0.0)


def _clip(ratio: Tensor, d_ratio: Tensor, adv: Tensor, epilogue) -> tuple[Tensor, Tensor]:
    """PPO's −min(r₁A, clip(ρ)A) with r₁ = min(ρ, δ), then the dual clip's floor −A·c for A < 0."""
    clipped = ratio.clamp(1 - epilogue.eps_low, 1 + epilogue.eps_high)
    d_clipped = d_ratio.masked_fill(clipped != ratio, 0.0)  # inside [1 − ε_low, 1 + ε_high], bounds included
    capped, d_capped = ratio, d_ratio
    if epilogue.delta is not None:
        capped = ratio.clamp(max=epilogue.delta)
        d_capped = d_ratio.masked_fill(ratio > epilogue.delta, 0.0)
    s1, s2 = capped * adv, clipped * adv
    loss = -torch.minimum(s1, s2)
    d_min = torch.where(s1 < s2, d_capped, torch.where(s2 < s1, d_clipped, (d_capped + d_clipped) * 0.5))
    dlogp = d_min.mul_(adv).neg_()
    if epilogue.clip_ratio_c is not None:  # the floor carries no gradient
        floor = adv * -epilogue.clip_ratio_c
        floored = (adv < 0) & (loss > floor)
        loss = torch.where(floored, floor, loss)
        dlogp.masked_fill_(floored, 0.0)
    return loss, dlogp


def _policy(logp: Tensor, *, ratio: Tensor, d_ratio: Tensor, adv: Tensor, epilogue) -> tuple[Tensor, Tensor]:
    """The policy term of `epilogue.kind` and its derivative w.r.t. logp."""
    if epilogue.kind == "clip":
        return _clip(ratio, d_ratio, adv, epilogue)
    if epilogue.kind == "cispo":  # −sg(w)·A·logp
        if epilogue.cispo_two_sided:
            weight = ratio.clamp(1 - epilogue.eps_low, 1 + epilogue.eps_high)
        else:
            weight = ratio.clamp(max=epilogue.eps_high)
        dlogp = -weight * adv
        return dlogp * logp, dlogp
    if epilogue.kind == "sapo":  # −σ(τ(ρ − 1))·4/τ·A
        tau = torch.where(adv > 0, epilogue.tau_pos, epilogue.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1))
        loss = -gate * 4 / tau * adv
        return loss, gate * (1 - gate) * -4 * adv * d_ratio
    if epilogue.kind == "gpg":  # −A·logp
        dlogp = -adv
        return dlogp * logp, dlogp.expand_as(logp)
    raise ValueError(f"no torch epilogue for the policy kind {epilogue.kind!r}")


def _kl(logp: Tensor, ref_logp: Tensor, estimator: str) -> tuple[Tensor, Tensor]:
    """The KL estimator of d = ref − logp (losses/kl.py) and its derivative w.r.t. logp."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d, torch.ones_like(logp)
    if estimator == "k2":
        return 0.5 * d.square(), -d
    clamped = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    grown = torch.expm1(clamped)
    kl = grown - clamped  # k3 = expm1(d) − d
    d_kl = grown.neg_().masked_fill_(d.abs() > LOG_RATIO_CLAMP, 0.0)
    if estimator == "low_var_kl":
        d_kl.masked_fill_(kl.abs() > LOW_VAR_KL_CLAMP, 0.0)
        kl = kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    elif estimator != "k3":
        raise ValueError(f"no torch epilogue for the KL estimator {estimator!r}")
    return kl, d_kl


def token_loss(logp: Tensor, mask: Tensor | None, sides: LossSides, epilogue) -> tuple[Tensor, Tensor]:
    """Each token's weighted loss and weighted dL/dlogp, [B, T], 0 at masked tokens (whatever padding holds);
    `mask` None: every token is kept."""
    ratio, d_ratio = _ratio(logp, sides.old_logp)
    loss, dlogp = _policy(logp, ratio=ratio, d_ratio=d_ratio, adv=sides.advantages, epilogue=epilogue)
    if sides.is_ratio is not None:
        loss, dlogp = loss * sides.is_ratio, dlogp * sides.is_ratio
    if epilogue.beta != 0.0:
        kl, d_kl = _kl(logp, sides.ref_logp, epilogue.kl_estimator)
        if epilogue.bias_correction:  # KL·ρ, ρ not detached
            kl, d_kl = kl * ratio, d_kl * ratio + kl * d_ratio
        loss, dlogp = loss.add(kl, alpha=epilogue.beta), dlogp.add(d_kl, alpha=epilogue.beta)
    loss, dlogp = loss * sides.weights, dlogp * sides.weights
    if mask is None:
        return loss, dlogp
    dropped = ~mask
    return loss.masked_fill_(dropped, 0.0), dlogp.masked_fill_(dropped, 0.0)


def grpo_loss_fwd(
    args: VocabPassArgs, sides: LossSides, epilogue
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """The pass (`token_logprobs_fwd`), then the epilogue: logp, lse, entropy|None, each token's weighted loss and
    weighted dL/dlogp, [B, T] in the compute dtype. The sides come in that dtype too; advantages / is_ratio may be
    [B, T] views of per-sequence values."""
    logp, lse, entropy, _ = token_logprobs_fwd(args)
    loss, dlogp = token_loss(logp, args.mask, sides, epilogue)
    return logp, lse, entropy, loss, dlogp


def closed_form_share(
    omega: Tensor, side: dict[str, Tensor | None], row_mask: Tensor | None, epilogue, dtype
) -> Callable[[slice, Tensor, Tensor | None], tuple[Tensor, Tensor, None]]:
    """The fused lm_head's chunk share of a token-level loss in closed form: `(rows, logp, entropy) -> (the share
    of the loss, dL/dlogp, None)` of the kept rows `rows` of `omega` and `side` (advantages, old_logp, ref_logp,
    is_ratio, [M] each or None); `row_mask` [M] drops padding rows (None: none)."""
    side = {name: None if x is None else x.to(dtype) for name, x in side.items()}  # [M] each

    def share(rows: slice, logp: Tensor, entropy: Tensor | None) -> tuple[Tensor, Tensor, None]:
        pick = lambda x: None if x is None else x[rows]  # noqa: E731  [c]
        mask = None if row_mask is None else row_mask[rows]
        sides = LossSides(weights=omega[rows], **{name: pick(x) for name, x in side.items()})
        loss, dlogp = token_loss(logp, mask, sides, epilogue)
        return loss.sum(), dlogp, None

    return share

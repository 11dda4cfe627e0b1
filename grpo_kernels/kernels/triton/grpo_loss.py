"""Token-level GRPO losses fused into the Triton forward pass: one online pass over V per row, then an epilogue
that forms the token's weighted loss and dL/dlogp, so the backward only has to scale them. When the rows cannot fill
the GPU, the pass runs as V-blocks (`token_logprobs.launch_partials`) and the epilogue after their merge.

The epilogue is a transcription of `grpo_kernels/losses/` (policy.py, kl.py) for the token-level terms; those
PyTorch functions stay the specification, and the tests hold this kernel to the float64 oracle.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from grpo_kernels.kernels.protocol import EPILOGUE_KL, LossSides, VocabPassArgs
from grpo_kernels.kernels.triton.row_stats import row_logprob_stats
from grpo_kernels.kernels.triton.token_logprobs import coefficients_of, launch_partials, merged_partials, vocab_plan

EPILOGUES = {"clip": 0, "cispo": 1, "sapo": 2, "gpg": 3}  # PolicyLoss.epilogue -> the kernel's POLICY constant
KL_KINDS = {kind: i for i, kind in enumerate(EPILOGUE_KL)}  # estimator -> the kernel's KL_KIND constant
LOG_RATIO_CLAMP = tl.constexpr(20.0)  # as losses/terms.py


@triton.jit
def _k3(d):
    """e^d − 1 − d without cancellation: its Taylor series (to d⁹/9!) for |d| < 0.5, the direct form beyond."""
    series = 1.0 / 40320.0 + d / 362880.0
    series = 1.0 / 5040.0 + d * series
    series = 1.0 / 720.0 + d * series
    series = 1.0 / 120.0 + d * series
    series = 1.0 / 24.0 + d * series
    series = 1.0 / 6.0 + d * series
    series = 0.5 + d * series
    return tl.where(tl.abs(d) < 0.5, d * d * series, tl.exp(d) - 1.0 - d)


@triton.jit
def _token_loss(logp, row, seq, t, weights_ptr, adv_ptr, adv_stride_b, adv_stride_t, old_ptr, ref_ptr, is_ptr,
                is_stride_b, is_stride_t, eps_low, eps_high, delta, clip_ratio_c, beta, tau_pos, tau_neg,
                POLICY: tl.constexpr, HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_DUAL_CLIP: tl.constexpr,
                CISPO_TWO_SIDED: tl.constexpr, HAS_KL: tl.constexpr, KL_KIND: tl.constexpr,
                BIAS_CORRECTION: tl.constexpr, HAS_IS: tl.constexpr):  # fmt: skip
    """(weighted loss, its derivative w.r.t. logp) of the kept token `row` (sequence `seq`, position `t`)."""
    adv = tl.load(adv_ptr + seq * adv_stride_b + t * adv_stride_t)
    # ρ = exp(clamp(logp − old, ±20)); d ρ / d logp = ρ inside the clamp, 0 outside (on-policy: ρ = 1)
    ratio = tl.full((), 1.0, tl.float32)
    d_ratio = ratio
    if HAS_OLD:
        log_ratio = logp - tl.load(old_ptr + row)
        ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP))
        d_ratio = tl.where(tl.abs(log_ratio) <= LOG_RATIO_CLAMP, ratio, 0.0)
    if POLICY == 0:  # clip: −min(r₁A, clip(ρ)A), r₁ = min(ρ, δ); torch.min splits the gradient on ties
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        capped = ratio
        d_capped = d_ratio
        if HAS_DELTA:
            capped = tl.minimum(ratio, delta)
            d_capped = tl.where(ratio <= delta, d_ratio, 0.0)
        d_clipped = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), d_ratio, 0.0)
        s1 = capped * adv
        s2 = clipped * adv
        loss = -tl.minimum(s1, s2)
        d_min = tl.where(s1 < s2, d_capped, tl.where(s2 < s1, d_clipped, 0.5 * (d_capped + d_clipped)))
        dlogp = -adv * d_min
        if HAS_DUAL_CLIP:  # A < 0: min(loss, −A·c), whose floor carries no gradient
            floored = (adv < 0) & (loss > -adv * clip_ratio_c)
            loss = tl.where(floored, -adv * clip_ratio_c, loss)
            dlogp = tl.where(floored, 0.0, dlogp)
    elif POLICY == 1:  # cispo: −sg(w)·A·logp, w = min(ρ, ε_high) or clip(ρ, 1 − ε_low, 1 + ε_high)
        if CISPO_TWO_SIDED:
            weight = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        else:
            weight = tl.minimum(ratio, eps_high)
        loss = -weight * adv * logp
        dlogp = -weight * adv
    elif POLICY == 2:  # sapo: −σ(τ(ρ − 1))·4/τ·A
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        gate = tl.sigmoid(tau * (ratio - 1.0))
        loss = -gate * 4.0 / tau * adv
        dlogp = -adv * 4.0 * gate * (1.0 - gate) * d_ratio
    else:  # gpg: −A·logp
        loss = -adv * logp
        dlogp = -adv
    if HAS_IS:
        is_weight = tl.load(is_ptr + seq * is_stride_b + t * is_stride_t)
        loss = loss * is_weight
        dlogp = dlogp * is_weight
    if HAS_KL:  # β·KL estimator of d = ref − logp (losses/kl.py)
        d = tl.load(ref_ptr + row) - logp
        if KL_KIND == 0:  # k1 = −d
            kl = -d
            d_kl = tl.full((), 1.0, tl.float32)
        elif KL_KIND == 1:  # k2 = d²/2
            kl = 0.5 * d * d
            d_kl = -d
        else:  # k3 = expm1(d) − d with d clamped to ±20; d k3 / d logp = −expm1(d) = −(k3 + d)
            d_c = tl.minimum(tl.maximum(d, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
            kl = _k3(d_c)
            d_kl = tl.where(tl.abs(d) <= LOG_RATIO_CLAMP, -(kl + d_c), 0.0)
            if KL_KIND == 3:  # low_var_kl: k3 clamped to ±10
                d_kl = tl.where(tl.abs(kl) <= 10.0, d_kl, 0.0)
                kl = tl.minimum(tl.maximum(kl, -10.0), 10.0)
        if BIAS_CORRECTION:  # KL·ρ (ρ not detached)
            d_kl = d_kl * ratio + kl * d_ratio
            kl = kl * ratio
        loss += beta * kl
        dlogp += beta * d_kl
    weight = tl.load(weights_ptr + row)
    return loss * weight, dlogp * weight


@triton.jit
def _grpo_loss_fwd_kernel(
    logits_ptr, stride_b, stride_t, targets_ptr, mask_ptr, weights_ptr, adv_ptr, adv_stride_b, adv_stride_t,
    old_ptr, ref_ptr, is_ptr, is_stride_b, is_stride_t, logp_ptr, lse_ptr, entropy_ptr, loss_ptr, dlogp_ptr,
    T, V, a, b, eps_low, eps_high, delta, clip_ratio_c, beta, tau_pos, tau_neg,
    HAS_SOFTCAP: tl.constexpr, POLICY: tl.constexpr, HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_DUAL_CLIP: tl.constexpr, CISPO_TWO_SIDED: tl.constexpr, HAS_KL: tl.constexpr, KL_KIND: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr, HAS_IS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """One row per program: its vocabulary pass, then the loss epilogue."""
    row = tl.program_id(0).to(tl.int64)
    logp = tl.zeros((), tl.float32)
    lse, entropy, loss, dlogp = logp, logp, logp, logp
    if tl.load(mask_ptr + row) != 0:
        seq = row // T
        t = row - seq * T
        target = tl.load(targets_ptr + row).to(tl.int32)
        logp, lse, entropy = row_logprob_stats(
            logits_ptr + seq * stride_b + t * stride_t, target, V, a, b, HAS_SOFTCAP, WITH_ENTROPY, BLOCK_V, VEC
        )
        loss, dlogp = _token_loss(
            logp, row, seq, t, weights_ptr, adv_ptr, adv_stride_b, adv_stride_t, old_ptr, ref_ptr, is_ptr,
            is_stride_b, is_stride_t, eps_low, eps_high, delta, clip_ratio_c, beta, tau_pos, tau_neg, POLICY, HAS_OLD,
            HAS_DELTA, HAS_DUAL_CLIP, CISPO_TWO_SIDED, HAS_KL, KL_KIND, BIAS_CORRECTION, HAS_IS,
        )  # fmt: skip
    _store_loss_row(row, logp, lse, entropy, loss, dlogp, logp_ptr, lse_ptr, entropy_ptr, loss_ptr, dlogp_ptr,
                    WITH_ENTROPY)  # fmt: skip


@triton.jit
def _grpo_loss_merge_kernel(
    partial_ptr, n_split, mask_ptr, weights_ptr, adv_ptr, adv_stride_b, adv_stride_t,
    old_ptr, ref_ptr, is_ptr, is_stride_b, is_stride_t, logp_ptr, lse_ptr, entropy_ptr, loss_ptr, dlogp_ptr,
    T, V, a, b, eps_low, eps_high, delta, clip_ratio_c, beta, tau_pos, tau_neg,
    HAS_SOFTCAP: tl.constexpr, POLICY: tl.constexpr, HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_DUAL_CLIP: tl.constexpr, CISPO_TWO_SIDED: tl.constexpr, HAS_KL: tl.constexpr, KL_KIND: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr, HAS_IS: tl.constexpr, WITH_ENTROPY: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """One row per program: the merge of its V-blocks' partial statistics (`launch_partials`), then the epilogue."""
    row = tl.program_id(0).to(tl.int64)
    logp = tl.zeros((), tl.float32)
    lse, entropy, loss, dlogp = logp, logp, logp, logp
    if tl.load(mask_ptr + row) != 0:
        seq = row // T
        t = row - seq * T
        logp, lse, entropy, _, _, _ = merged_partials(partial_ptr, row, n_split, V, a, b, HAS_SOFTCAP, SPLITS)
        loss, dlogp = _token_loss(
            logp, row, seq, t, weights_ptr, adv_ptr, adv_stride_b, adv_stride_t, old_ptr, ref_ptr, is_ptr,
            is_stride_b, is_stride_t, eps_low, eps_high, delta, clip_ratio_c, beta, tau_pos, tau_neg, POLICY, HAS_OLD,
            HAS_DELTA, HAS_DUAL_CLIP, CISPO_TWO_SIDED, HAS_KL, KL_KIND, BIAS_CORRECTION, HAS_IS,
        )  # fmt: skip
    _store_loss_row(row, logp, lse, entropy, loss, dlogp, logp_ptr, lse_ptr, entropy_ptr, loss_ptr, dlogp_ptr,
                    WITH_ENTROPY)  # fmt: skip


@triton.jit
def _store_loss_row(row, logp, lse, entropy, loss, dlogp, logp_ptr, lse_ptr, entropy_ptr, loss_ptr, dlogp_ptr,
                    WITH_ENTROPY: tl.constexpr):  # fmt: skip
    tl.store(logp_ptr + row, logp)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, loss)
    tl.store(dlogp_ptr + row, dlogp)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


def grpo_loss_fwd(
    args: VocabPassArgs, sides: LossSides, epilogue
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """One pass: logp, lse, entropy|None, weighted per-token loss, weighted dL/dlogp, each [B, T] float32.

    The sides' weights, old/ref float32 contiguous, advantages / is_ratio [B, T] views (stride 0 in T for
    per-sequence values); `epilogue` a `TokenEpilogue` (the policy kind and its hyperparameters).
    """
    logits, with_entropy, weights, advantages = args.logits, args.with_entropy, sides.weights, sides.advantages
    old_logp, ref_logp, is_ratio = sides.old_logp, sides.ref_logp, sides.is_ratio
    B, T, V = logits.shape
    targets, mask = args.targets.contiguous(), args.mask.contiguous()
    logp = weights.new_empty((B, T))  # [B, T]
    lse, loss, dlogp = (weights.new_empty((B, T)) for _ in range(3))  # [B, T] each
    entropy = weights.new_empty((B, T)) if with_entropy else None  # [B, T]
    a, b = coefficients_of(args)
    plan = vocab_plan(logits)
    token_inputs = (
        weights, advantages, advantages.stride(0), advantages.stride(1),
        logp if old_logp is None else old_logp, logp if ref_logp is None else ref_logp,
        logp if is_ratio is None else is_ratio,
        0 if is_ratio is None else is_ratio.stride(0), 0 if is_ratio is None else is_ratio.stride(1),
        logp, lse, logp if entropy is None else entropy, loss, dlogp,
        T, V, a, b, epilogue.eps_low, epilogue.eps_high,
        1.0 if epilogue.delta is None else epilogue.delta,
        1.0 if epilogue.clip_ratio_c is None else epilogue.clip_ratio_c,
        epilogue.beta, epilogue.tau_pos, epilogue.tau_neg,
    )  # fmt: skip
    flags = dict(
        HAS_SOFTCAP=args.softcap is not None,
        POLICY=EPILOGUES[epilogue.kind],
        HAS_OLD=old_logp is not None,
        HAS_DELTA=epilogue.delta is not None,
        HAS_DUAL_CLIP=epilogue.clip_ratio_c is not None,
        CISPO_TWO_SIDED=epilogue.cispo_two_sided,
        HAS_KL=epilogue.beta != 0.0,
        KL_KIND=KL_KINDS[epilogue.kl_estimator],
        BIAS_CORRECTION=epilogue.bias_correction,
        HAS_IS=is_ratio is not None,
        WITH_ENTROPY=with_entropy,
    )
    if plan["splits"] == 1:
        _grpo_loss_fwd_kernel[(B * T,)](
            logits, logits.stride(0), logits.stride(1), targets, mask, *token_inputs, **flags,
            BLOCK_V=plan["block_v"], VEC=plan["vec"], num_warps=plan["warps"], enable_fp_fusion=True,
        )  # fmt: skip
    else:
        pass_flags = dict(HAS_SOFTCAP=args.softcap is not None, WITH_ENTROPY=with_entropy)
        pass_flags |= dict(WITH_SUM_SQ=False, WITH_MEAN=False, WITH_TOP1=False)
        partial = launch_partials(logits, targets, mask, a, b, pass_flags, plan)
        _grpo_loss_merge_kernel[(B * T,)](
            partial, plan["splits"], mask, *token_inputs, **flags, SPLITS=triton.next_power_of_2(plan["splits"]),
            num_warps=1, enable_fp_fusion=True,
        )  # fmt: skip
    return logp, lse, entropy, loss, dlogp

"""Vocabulary pass in Triton: one program per token row, one online pass over V forward, one pass backward.

Forward keeps a running max m, sum-exp s = Σ e^(z−m) and t = Σ e^(z−m)·(z−m) (for the entropy), rescaling
them when m grows, so logits are read exactly once. In float32 whatever the input dtype. Rows the mask drops
are not read. The grid is 1-D over rows (no 65535 limit), with 64-bit offsets.

The softmax sees z = b·tanh(a·x) with soft-capping (HAS_SOFTCAP), else z = a·x, for raw logits x
(`transform_coefficients`); without soft-capping that is the one multiply by 1/T it always was. On request the
forward also folds Σ e^(2(z−m)) (log Σ q²), Σ z (the mean logit) and the max before the target (top-1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK_V = 4096
_FLOAT32_LOWEST = tl.constexpr(
    -3.4028234663852886e38
)  # running-max start: finite, so e^(m_old − m_new) never sees inf − inf


def block_v_for(vocab: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab))


def num_warps_for(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def transform_coefficients(temperature: float, logit_scale: float, softcap: float | None) -> tuple[float, float]:
    """(a, b) with z = b·tanh(a·x) = c·tanh(s·x/c)/T when soft-capped (a = s/c, b = c/T), else z = a·x (a = s/T)."""
    if softcap is None:
        return logit_scale / temperature, 1.0
    return logit_scale / softcap, softcap / temperature


@triton.jit
def softcapped(y, b):
    """(b·tanh(y), 1 − tanh²(y)) from one exp: tanh|y| = (1 − e)/(1 + e) and sech² y = 4e/(1 + e)², e = e^(−2|y|)."""
    e = tl.exp(-2.0 * tl.abs(y))
    r = 1.0 / (1.0 + e)
    tanh_abs = (1.0 - e) * r
    return b * tl.where(y < 0, -tanh_abs, tanh_abs), 4.0 * e * r * r


@triton.jit
def transformed(x, a, b, HAS_SOFTCAP: tl.constexpr):
    """The logits the softmax sees: b·tanh(a·x) with soft-capping, else a·x."""
    z = x * a
    if HAS_SOFTCAP:
        z, _ = softcapped(z, b)
    return z


@triton.jit
def row_logprob_stats(
    row_ptr,
    target,
    V,
    a,
    b,
    HAS_SOFTCAP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_SUM_SQ: tl.constexpr,
    WITH_MEAN: tl.constexpr,
    WITH_TOP1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """(logp of `target`, lse, entropy, log Σ q², mean z, target is the first argmax) of one row of transformed
    logits z, in one online pass (each extra statistic 0 unless asked)."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), _FLOAT32_LOWEST, tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    sq = tl.zeros((), tl.float32)
    z_sum = tl.zeros((), tl.float32)
    before = tl.full((), -float("inf"), tl.float32)  # max z over the columns before the target
    at = tl.full((), -float("inf"), tl.float32)  # z at the target, as the loop saw it (for the top-1 test)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * a
        if HAS_SOFTCAP:
            z, _ = softcapped(z, b)
            z = tl.where(cols < V, z, -float("inf"))  # the padding's tanh(−inf) = −1 must not count
        if WITH_MEAN:
            z_sum += tl.sum(tl.where(cols < V, z, 0.0), axis=0)
        if WITH_TOP1:
            before = tl.maximum(before, tl.max(tl.where(cols < target, z, -float("inf")), axis=0))
            at = tl.maximum(at, tl.max(tl.where(cols == target, z, -float("inf")), axis=0))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        if WITH_ENTROPY:
            # Σ e·(z − m_new) = scale·(t + s·(m − m_new)) + this block's terms
            t = scale * (t + s * (m - m_new)) + tl.sum(e * tl.where(e > 0, z - m_new, 0.0), axis=0)
        if WITH_SUM_SQ:
            sq = sq * scale * scale + tl.sum(e * e, axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_target = transformed(tl.load(row_ptr + target).to(tl.float32), a, b, HAS_SOFTCAP)
    logp = z_target - lse
    entropy = tl.log(s) - t / s
    if WITH_SUM_SQ:
        sq = tl.log(sq) - 2.0 * tl.log(s)  # log Σ q²
    if WITH_MEAN:
        z_sum = z_sum / V
    return logp, lse, entropy, sq, z_sum, (at >= m) & (at > before)


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    targets_ptr,
    mask_ptr,
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    sum_sq_ptr,
    mean_ptr,
    top1_ptr,
    T,
    V,
    a,
    b,
    HAS_SOFTCAP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_SUM_SQ: tl.constexpr,
    WITH_MEAN: tl.constexpr,
    WITH_TOP1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logp = tl.zeros((), tl.float32)
    lse = tl.zeros((), tl.float32)
    entropy = tl.zeros((), tl.float32)
    log_sum_sq = tl.zeros((), tl.float32)
    mean = tl.zeros((), tl.float32)
    top1 = tl.zeros((), tl.int1)
    if tl.load(mask_ptr + row) != 0:
        seq = row // T
        row_ptr = logits_ptr + seq * stride_b + (row - seq * T) * stride_t
        target = tl.load(targets_ptr + row)
        logp, lse, entropy, log_sum_sq, mean, top1 = row_logprob_stats(
            row_ptr, target, V, a, b, HAS_SOFTCAP, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN, WITH_TOP1, BLOCK_V
        )
    tl.store(logp_ptr + row, logp)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)
    if WITH_SUM_SQ:
        tl.store(sum_sq_ptr + row, log_sum_sq)
    if WITH_MEAN:
        tl.store(mean_ptr + row, mean)
    if WITH_TOP1:
        tl.store(top1_ptr + row, top1.to(tl.int8))


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    out_ptr,
    out_stride_b,
    out_stride_t,
    targets_ptr,
    mask_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    T,
    V,
    a,
    b,
    HAS_SOFTCAP: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seq = row // T
    t_idx = row - seq * T
    row_ptr = logits_ptr + seq * stride_b + t_idx * stride_t
    out_row_ptr = out_ptr + seq * out_stride_b + t_idx * out_stride_t
    offs = tl.arange(0, BLOCK_V)
    if tl.load(mask_ptr + row) != 0:
        lse = tl.load(lse_ptr + row)
        target = tl.load(targets_ptr + row)
        g = tl.zeros((), tl.float32)
        g_h = tl.zeros((), tl.float32)
        h = tl.zeros((), tl.float32)
        if HAS_GRAD_LOGP:
            g = tl.load(grad_logp_ptr + row).to(tl.float32)
        if HAS_GRAD_ENTROPY:
            g_h = tl.load(grad_entropy_ptr + row).to(tl.float32)
            h = tl.load(entropy_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * a
            if HAS_SOFTCAP:
                z, sech2 = softcapped(z, b)
            log_q = z - lse
            q = tl.exp(log_q)
            grad = tl.where(cols == target, g, 0.0) - g * q
            if HAS_GRAD_ENTROPY:
                grad -= g_h * q * tl.where(q > 0, log_q + h, 0.0)
            grad = grad * a  # dz/dx: a, or a·b·sech²(a·x) with soft-capping
            if HAS_SOFTCAP:
                grad = grad * (b * sech2)
            tl.store(out_row_ptr + cols, grad.to(out_ptr.dtype.element_ty), mask=cols < V)
    else:
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            tl.store(out_row_ptr + cols, tl.zeros((BLOCK_V,), out_ptr.dtype.element_ty), mask=cols < V)


def token_logprobs_fwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    stats: tuple[str, ...] = (),
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """logits [B, T, V] (last stride 1), targets [B, T], mask [B, T] bool -> logp, lse, entropy|None, [B, T] fp32,
    and the requested `stats` by name ([B, T]; `is_top1` bool)."""
    B, T, V = logits.shape
    targets, mask = targets.contiguous(), mask.contiguous()
    logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)  # [B, T]
    lse = torch.empty_like(logp)  # [B, T]
    entropy = torch.empty_like(logp) if with_entropy else None  # [B, T]
    out = {name: torch.empty_like(logp, dtype=torch.int8 if name == "is_top1" else None) for name in stats}
    a, b = transform_coefficients(temperature, logit_scale, softcap)
    block_v = block_v_for(V)
    _token_logprobs_fwd_kernel[(B * T,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        targets,
        mask,
        logp,
        lse,
        logp if entropy is None else entropy,
        out.get("log_sum_sq_probs", logp),
        out.get("mean_logits", logp),
        out.get("is_top1", logp),
        T,
        V,
        a,
        b,
        HAS_SOFTCAP=softcap is not None,
        WITH_ENTROPY=with_entropy,
        WITH_SUM_SQ="log_sum_sq_probs" in out,
        WITH_MEAN="mean_logits" in out,
        WITH_TOP1="is_top1" in out,
        BLOCK_V=block_v,
        num_warps=num_warps_for(block_v),
    )
    if "is_top1" in out:
        out["is_top1"] = out["is_top1"].bool()
    return logp, lse, entropy, out


def token_logprobs_bwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    out: Tensor,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> None:
    """Write dL/dlogits into `out` (may be `logits` itself; last strides 1); masked rows get 0."""
    B, T, V = logits.shape
    targets, mask = targets.contiguous(), mask.contiguous()
    grad_logp = None if grad_logp is None else grad_logp.contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
    a, b = transform_coefficients(temperature, logit_scale, softcap)
    block_v = block_v_for(V)
    _token_logprobs_bwd_kernel[(B * T,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        targets,
        mask,
        lse,
        lse if entropy is None else entropy,
        lse if grad_logp is None else grad_logp,
        lse if grad_entropy is None else grad_entropy,
        T,
        V,
        a,
        b,
        HAS_SOFTCAP=softcap is not None,
        HAS_GRAD_LOGP=grad_logp is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        BLOCK_V=block_v,
        num_warps=num_warps_for(block_v),
    )

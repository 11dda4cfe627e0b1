"""Vocabulary pass in Triton: one program per token row, one online pass over V forward, one pass backward.

Forward keeps a running max m, sum-exp s = Σ e^(z−m) and t = Σ e^(z−m)·(z−m) (for the entropy), rescaling
them when m grows, so logits are read exactly once. In float32 whatever the input dtype. Rows the mask drops
are not read. The grid is 1-D over rows (no 65535 limit), with 64-bit offsets.
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


@triton.jit
def row_logprob_stats(row_ptr, target, V, inv_temperature, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """(logp of `target`, lse, entropy) of one row of logits / T, in one online pass (entropy 0 unless asked)."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), _FLOAT32_LOWEST, tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        if WITH_ENTROPY:
            # Σ e·(z − m_new) = scale·(t + s·(m − m_new)) + this block's terms
            t = scale * (t + s * (m - m_new)) + tl.sum(e * tl.where(e > 0, z - m_new, 0.0), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    lse = m + tl.log(s)
    logp = tl.load(row_ptr + target).to(tl.float32) * inv_temperature - lse
    entropy = tl.log(s) - t / s
    return logp, lse, entropy


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
    T,
    V,
    inv_temperature,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logp = tl.zeros((), tl.float32)
    lse = tl.zeros((), tl.float32)
    entropy = tl.zeros((), tl.float32)
    if tl.load(mask_ptr + row) != 0:
        b = row // T
        row_ptr = logits_ptr + b * stride_b + (row - b * T) * stride_t
        target = tl.load(targets_ptr + row)
        logp, lse, entropy = row_logprob_stats(row_ptr, target, V, inv_temperature, WITH_ENTROPY, BLOCK_V)
    tl.store(logp_ptr + row, logp)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


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
    inv_temperature,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t_idx = row - b * T
    row_ptr = logits_ptr + b * stride_b + t_idx * stride_t
    out_row_ptr = out_ptr + b * out_stride_b + t_idx * out_stride_t
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
            z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temperature
            log_q = z - lse
            q = tl.exp(log_q)
            grad = tl.where(cols == target, g, 0.0) - g * q
            if HAS_GRAD_ENTROPY:
                grad -= g_h * q * tl.where(q > 0, log_q + h, 0.0)
            grad = grad * inv_temperature
            tl.store(out_row_ptr + cols, grad.to(out_ptr.dtype.element_ty), mask=cols < V)
    else:
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            tl.store(out_row_ptr + cols, tl.zeros((BLOCK_V,), out_ptr.dtype.element_ty), mask=cols < V)


def token_logprobs_fwd(
    logits: Tensor, targets: Tensor, mask: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """logits [B, T, V] (last stride 1), targets [B, T], mask [B, T] bool -> logp, lse, entropy|None, [B, T] fp32."""
    B, T, V = logits.shape
    targets, mask = targets.contiguous(), mask.contiguous()
    logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)  # [B, T]
    lse = torch.empty_like(logp)  # [B, T]
    entropy = torch.empty_like(logp) if with_entropy else None  # [B, T]
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
        T,
        V,
        1.0 / temperature,
        WITH_ENTROPY=with_entropy,
        BLOCK_V=block_v,
        num_warps=num_warps_for(block_v),
    )
    return logp, lse, entropy


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
) -> None:
    """Write dL/dlogits into `out` (may be `logits` itself; last strides 1); masked rows get 0."""
    B, T, V = logits.shape
    targets, mask = targets.contiguous(), mask.contiguous()
    grad_logp = None if grad_logp is None else grad_logp.contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
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
        1.0 / temperature,
        HAS_GRAD_LOGP=grad_logp is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        BLOCK_V=block_v,
        num_warps=num_warps_for(block_v),
    )

"""The top-k-plus-tail divergence on one chunk of rows, in Triton: `kernels/torch/divergence_topk.py`'s math (each
head's full-vocabulary log-probs at the teacher's k ids, plus one tail bucket with the rest of its mass, then the
divergence over those k + 1 outcomes) in one launch per chunk.

The ids come from torch (given, or `torch.topk` on the teacher's raw chunk logits: its transform is monotonic, so its
top k are the raw top k, or bottom k for a negative logit scale). The wrapper gathers both heads' raw logits at the ids
and marks those columns NaN in the teacher's buffer; one program per row then sweeps its vocabulary twice:
1. each head's log Σ e^z over the unmarked columns, online (the tail, exact however small: no 1 − Σ p_top), and the
   count of marked columns: a row that does not count k (a NaN logit of the teacher's own) gets a NaN divergence;
   with the k gathered logits, each head's lse, the k + 1 log-probs and the divergence over them and its gradient g
   in those log-probs (as `kernels/triton/divergence.py` forms them over the vocabulary);
2. the student's entropy over the unmarked columns (the ids' terms come from the gathered logits) and, with the
   gradient, dD/dx = g_tail·p_v/P_tail·dz/dx there; the ids' g_i·dz/dx are stored at the ids last.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from grpo_kernels.kernels.torch.divergence import ChunkSpec
from grpo_kernels.kernels.triton.divergence import (
    _FLOAT32_LOWEST,
    NUM_WARPS,
    OUTPUTS,
    _head,
    _log_mix,
    _weighted,
    block_v_for,
    scalar_arguments,
    store_outputs,
    target_logit,
)


@triton.jit
def _online(m, s, z):
    """One step of a per-lane online log Σ e^z: (running max, Σ e^(z − max))."""
    m_new = tl.maximum(m, z)
    return m_new, s * tl.exp(m - m_new) + tl.exp(z - m_new)


@triton.jit
def _merged(m, s):
    """log Σ e^z of the lanes' running (max, sum): −inf when every z was −inf."""
    top = tl.max(m, axis=0)
    return top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))


@triton.jit
def _log_add(x, y):
    """log(e^x + e^y), −inf when both are −inf."""
    top = tl.maximum(x, y)
    return tl.where(top == -float("inf"), -float("inf"), top + tl.log(tl.exp(x - top) + tl.exp(y - top)))


@triton.jit
def _topk_divergence_chunk_kernel(
    s_ptr, s_stride_row, s_stride_v, t_ptr, t_stride_row, t_stride_v, kept_s_ptr, kept_t_ptr, ids_ptr, targets_ptr,
    out_ptr, rows, V, k, a_s, b_s, capped_s, a_t, b_t, capped_t, has_targets, beta, log_1mb, log_b,
    KIND: tl.constexpr, WITH_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One row per program: out [5, rows] (`OUTPUTS`); the teacher's row holds NaN at the k ids, kept_s / kept_t
    `[rows, k]` the raw logits there; with WITH_GRAD the student's logits become dD/dx."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * s_stride_row
    t_row = t_ptr + row * t_stride_row
    z_target = target_logit(s_row, s_stride_v, targets_ptr, row, has_targets, a_s, b_s, capped_s)
    cols = tl.arange(0, BLOCK_V)
    m_s = tl.full((BLOCK_V,), _FLOAT32_LOWEST, tl.float32)
    m_t = tl.full((BLOCK_V,), _FLOAT32_LOWEST, tl.float32)
    sum_s = tl.zeros((BLOCK_V,), tl.float32)
    sum_t = tl.zeros((BLOCK_V,), tl.float32)
    marked = tl.zeros((BLOCK_V,), tl.int32)
    for start in range(0, V, BLOCK_V):
        valid = start + cols < V
        zs = _head(s_row, start + cols, s_stride_v, valid, a_s, b_s, capped_s)[0]
        zt = _head(t_row, start + cols, t_stride_v, valid, a_t, b_t, capped_t)[0]
        outside = zt == zt  # not NaN: not an id
        marked += (~outside).to(tl.int32)
        m_s, sum_s = _online(m_s, sum_s, tl.where(outside, zs, -float("inf")))
        m_t, sum_t = _online(m_t, sum_t, tl.where(outside, zt, -float("inf")))
    tail_s = _merged(m_s, sum_s)  # log Σ e^z outside the ids
    tail_t = _merged(m_t, sum_t)
    j = tl.arange(0, BLOCK_K)
    at_id = j < k
    z_ids_s, derivative_ids = _head(kept_s_ptr + row * k, j, 1, at_id, a_s, b_s, capped_s)
    z_ids_t = _head(kept_t_ptr + row * k, j, 1, at_id, a_t, b_t, capped_t)[0]
    lowest = tl.full((BLOCK_K,), _FLOAT32_LOWEST, tl.float32)
    lse_s = _log_add(tail_s, _merged(*_online(lowest, tl.zeros((BLOCK_K,), tl.float32), z_ids_s)))
    lse_t = _log_add(tail_t, _merged(*_online(lowest, tl.zeros((BLOCK_K,), tl.float32), z_ids_t)))
    ys = tl.where(at_id, z_ids_s - lse_s, tl.where(j == k, tail_s - lse_s, -float("inf")))  # the k + 1 log-probs
    yt = tl.where(at_id, z_ids_t - lse_t, tl.where(j == k, tail_t - lse_t, -float("inf")))
    ps = tl.exp(ys)
    pt = tl.exp(yt)
    if KIND == 0:
        divergence = tl.sum(_weighted(pt, yt - ys), axis=0)
        g = ps - pt
    elif KIND == 1:
        divergence = tl.sum(_weighted(ps, ys - yt), axis=0)
        g = _weighted(ps, ys - yt - divergence)
    else:
        log_m = _log_mix(ys, yt, log_1mb, log_b)
        centre = tl.sum(_weighted(ps, ys - log_m), axis=0)
        divergence = beta * tl.sum(_weighted(pt, yt - log_m), axis=0) + (1.0 - beta) * centre
        g = _weighted(ps, ys - log_m - centre) * (1.0 - beta)
    divergence = tl.where(tl.sum(marked, axis=0) == k, divergence, float("nan"))
    g_tail = tl.sum(tl.where(j == k, g, 0.0), axis=0)
    logp = z_target - lse_s  # (unused without targets)
    entropy = tl.where(at_id, -_weighted(ps, ys), 0.0)  # the ids' terms; the rest's below
    outside_entropy = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        valid = start + cols < V
        zs, derivative = _head(s_row, start + cols, s_stride_v, valid, a_s, b_s, capped_s)
        raw_t = tl.load(t_row + (start + cols).to(tl.int64) * t_stride_v, mask=valid, other=0.0)
        outside = raw_t == raw_t
        ls = zs - lse_s
        outside_entropy -= tl.where(outside, _weighted(tl.exp(ls), ls), 0.0)
        if WITH_GRAD:
            share = tl.where(tail_s > -float("inf"), tl.exp(zs - tail_s), 0.0)  # p_v / P_tail
            ptrs = s_row + (start + cols).to(tl.int64) * s_stride_v
            tl.store(ptrs, g_tail * share * derivative, mask=valid & outside)
    entropy = tl.sum(entropy, axis=0) + tl.sum(outside_entropy, axis=0)
    if WITH_GRAD:
        ids = tl.load(ids_ptr + row * k + j, mask=at_id, other=0)
        tl.store(s_row + ids * s_stride_v, g * derivative_ids, mask=at_id)
    store_outputs(out_ptr, rows, row, divergence, entropy, logp, lse_s, lse_t)


def topk_divergence_chunk(
    zs: Tensor, zt: Tensor, targets: Tensor | None, spec: ChunkSpec, *, k: int, ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """`kernels/torch/divergence_topk.topk_divergence_chunk` in one launch: (divergence, entropy, logp of `targets` or
    None, student lse, teacher lse) `[c]` float32 each and the ids `[c, k]` (`ids` given, or the teacher's top k),
    from the raw float32 logits zs, zt `[c, V]`; zt is overwritten (NaN at the ids), zs with dD/dx_s when
    `spec.with_grad`."""
    heads, divergence_args, kind = scalar_arguments(zs, zt, spec)
    rows, V = zs.shape
    if ids is None:  # the transform is monotonic: increasing unless the logit scale is negative
        ids = zt.topk(k, -1, largest=spec.teacher.logit_scale >= 0).indices
    ids = ids.contiguous()
    kept_s, kept_t = zs.gather(1, ids), zt.gather(1, ids)  # [c, k] each
    zt.scatter_(1, ids, math.nan)  # marks the ids' columns for the kernel
    out = torch.empty((len(OUTPUTS), rows), dtype=torch.float32, device=zs.device)  # [5, c]
    if rows:
        _topk_divergence_chunk_kernel[(rows,)](
            zs, zs.stride(0), zs.stride(1), zt, zt.stride(0), zt.stride(1), kept_s, kept_t, ids,
            out if targets is None else targets, out, rows, V, k, *heads, targets is not None, *divergence_args,
            KIND=kind, WITH_GRAD=spec.with_grad, BLOCK_V=block_v_for(V, spec.block),
            BLOCK_K=triton.next_power_of_2(k + 1), num_warps=NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
    divergence, entropy, logp, lse_s, lse_t = out.unbind(0)
    return divergence, entropy, None if targets is None else logp, lse_s, lse_t, ids

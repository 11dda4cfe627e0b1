"""The two-head divergence on one chunk of rows, in Triton: the student's and the teacher's raw logits `[c, V]` in,
per-row divergence, student entropy, log-prob of the sampled token and both heads' log-sum-exps out, and dD/dx of the
student's logits written over the student's logits (the buffer the driver's dH / dW GEMMs then read).

One program per row, in up to three sweeps over its vocabulary in BLOCK_V-wide blocks, each head's transform
z = c·tanh(s·x/c)/T (or s·x/T) done in the kernel on every load:
1. both heads' log-sum-exps, online: per lane a running max and Σ e^(z − max), merged once at the end (a max that
   starts finite, so that an all −inf block gives e^(−inf) = 0, never −inf − (−inf));
2. with log p = z − lse: the entropy −Σ p_s log p_s, the divergence (KIND 0 forward KL Σ p_t (log p_t − log p_s),
   1 reverse KL Σ p_s (log p_s − log p_t), 2 the generalized JSD with m = (1 − β)·p_s + β·p_t); the forward KL's
   gradient (p_s − p_t)·dz/dx is stored here;
3. (reverse KL, JSD) the gradient, which needs the row's sum first: p_s·(log p_s − log p_t − D)·dz/dx, or
   (1 − β)·p_s·(log p_s − log m − KL(p_s || m))·dz/dx.
A term whose weight p is 0 is 0 (0·log 0 = 0), so −inf logits anywhere are exact; a token one side reaches and the
other excludes gives +inf, as in `reference_divergence`. The math is `kernels/torch/divergence.py`'s, in float32.

A token-level loss sharing the sweeps (`token_loss`, the GRPO loss of a step with a teacher term) needs its
dL/dlogp and dL/dentropy, known only once the rows' logp and entropy are: the kernel then runs without its gradient
sweeps, the loss is called on the host, and a second kernel (`_token_gradient_kernel`) writes the summed gradient
from per-row coefficients (`torch/divergence.row_coefficients`): two launches per chunk, and no vocabulary pass of
the loss's own.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from grpo_kernels.kernels.torch.divergence import ChunkSpec, TokenLoss, row_coefficients
from grpo_kernels.kernels.triton.token_logprobs import softcapped, transform_coefficients

KINDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
OUTPUTS = ("divergence", "entropy", "logp", "lse_s", "lse_t")  # the rows of the kernels' [5, c] outputs
CENTRE = len(OUTPUTS)  # the chunk kernel's sixth output row: the student gradient's centre (D, or KL(p_s || m))
_CENTRE = tl.constexpr(CENTRE)
MAX_BLOCK_V = 1024
NUM_WARPS = 8
_FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)


def kind_of(beta: float) -> int:
    """The kernel's KIND for `beta`: 0 forward KL, 1 reverse KL, 2 generalized JSD."""
    return KINDS["forward_kl"] if beta == 0.0 else KINDS["reverse_kl"] if beta == 1.0 else KINDS["jsd"]


def block_v_for(vocab: int, block: int) -> int:
    """Columns per block: a power of two, at most MAX_BLOCK_V, `block` and about half of V (a row of whole blocks
    and a tail), at least 16."""
    largest = min(MAX_BLOCK_V, 1 << (max(block, 16).bit_length() - 1))
    return max(16, min(largest, triton.next_power_of_2(vocab // 2 + 1) // 2))


@triton.jit
def _head(row_ptr, cols, stride_v, valid, a, b, capped):
    """(z, dz/dx) of a block of a head's raw logits (float32); z = −inf off the row (`valid` False)."""
    y = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=valid, other=-float("inf")).to(tl.float32) * a
    z = y
    derivative = tl.zeros_like(y) + a
    if capped:
        z, sech2 = softcapped(y, b)
        derivative = sech2 * (a * b)
    return tl.where(valid, z, -float("inf")), derivative


@triton.jit
def _lse(row_ptr, stride_v, V, a, b, capped, BLOCK_V: tl.constexpr):
    """log Σ e^z over a row: −inf when every z is −inf."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), _FLOAT32_LOWEST, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        z, _ = _head(row_ptr, start + cols, stride_v, start + cols < V, a, b, capped)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    top = tl.max(m, axis=0)
    return top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))


@triton.jit
def _log_probs(s_row, s_stride_v, lse_s, t_row, t_stride_v, lse_t, cols, valid, a_s, b_s, capped_s, a_t, b_t,
               capped_t):  # fmt: skip
    """(log p_s, log p_t, dz_s/dx_s) of a block of both heads' columns."""
    zs, derivative = _head(s_row, cols, s_stride_v, valid, a_s, b_s, capped_s)
    zt, _ = _head(t_row, cols, t_stride_v, valid, a_t, b_t, capped_t)
    return zs - lse_s, zt - lse_t, derivative


@triton.jit
def _weighted(p, log_ratio):
    """p · log_ratio, 0 where p is 0 (whatever the log ratio)."""
    return tl.where(p > 0, p * log_ratio, 0.0)


@triton.jit
def _log_mix(ls, lt, log_1mb, log_b):
    """log((1 − β)·p_s + β·p_t) from log p_s, log p_t; −inf where both are 0."""
    u = ls + log_1mb
    w = lt + log_b
    top = tl.maximum(u, w)
    low = tl.minimum(u, w)
    return tl.where(top == -float("inf"), -float("inf"), top + tl.log(1.0 + tl.exp(low - top)))


@triton.jit
def target_logit(s_row, s_stride_v, targets_ptr, row, has_targets, a_s, b_s, capped_s):
    """z of the row's target (0 without targets), read first: the log-sum-exp's block reductions that follow hold
    every warp until all have read it, so no warp's gradient store can overwrite it before another's read."""
    z_target = tl.zeros((), tl.float32)
    if has_targets:
        target = tl.load(targets_ptr + row)
        z_target = _head(s_row, target, s_stride_v, target >= 0, a_s, b_s, capped_s)[0]
    return z_target


@triton.jit
def _divergence_chunk_kernel(
    s_ptr, s_stride_row, s_stride_v, t_ptr, t_stride_row, t_stride_v, targets_ptr, out_ptr,
    rows, V, a_s, b_s, capped_s, a_t, b_t, capped_t, has_targets, beta, log_1mb, log_b,
    KIND: tl.constexpr, WITH_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One row per program: out [6, rows] (`OUTPUTS`, then `CENTRE`); with WITH_GRAD the student's logits become
    dD/dx."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * s_stride_row
    t_row = t_ptr + row * t_stride_row
    z_target = target_logit(s_row, s_stride_v, targets_ptr, row, has_targets, a_s, b_s, capped_s)
    lse_s = _lse(s_row, s_stride_v, V, a_s, b_s, capped_s, BLOCK_V)
    lse_t = _lse(t_row, t_stride_v, V, a_t, b_t, capped_t, BLOCK_V)
    logp = z_target - lse_s  # (unused without targets)
    cols = tl.arange(0, BLOCK_V)
    entropy = tl.zeros((BLOCK_V,), tl.float32)  # −Σ p_s log p_s
    kl_teacher = tl.zeros((BLOCK_V,), tl.float32)  # Σ p_t (log p_t − ·): the forward KL, or the JSD's teacher side
    kl_student = tl.zeros((BLOCK_V,), tl.float32)  # Σ p_s (log p_s − ·): the reverse KL, or the JSD's student side
    for start in range(0, V, BLOCK_V):
        valid = start + cols < V
        ls, lt, derivative = _log_probs(s_row, s_stride_v, lse_s, t_row, t_stride_v, lse_t, start + cols, valid, a_s,
                                        b_s, capped_s, a_t, b_t, capped_t)  # fmt: skip
        ps = tl.exp(ls)
        pt = tl.exp(lt)
        entropy -= _weighted(ps, ls)
        if KIND == 0:
            kl_teacher += _weighted(pt, lt - ls)
            if WITH_GRAD:
                ptrs = s_row + (start + cols).to(tl.int64) * s_stride_v
                tl.store(ptrs, (ps - pt) * derivative, mask=valid)
        elif KIND == 1:
            kl_student += _weighted(ps, ls - lt)
        else:
            log_m = _log_mix(ls, lt, log_1mb, log_b)
            kl_teacher += _weighted(pt, lt - log_m)
            kl_student += _weighted(ps, ls - log_m)
    teacher_side = tl.sum(kl_teacher, axis=0)
    centre = tl.sum(kl_student, axis=0)  # the reverse KL, or KL(p_s || m)
    if KIND == 0:
        divergence = teacher_side
    elif KIND == 1:
        divergence = centre
    else:
        divergence = beta * teacher_side + (1.0 - beta) * centre
    if WITH_GRAD and KIND != 0:
        for start in range(0, V, BLOCK_V):
            valid = start + cols < V
            ls, lt, derivative = _log_probs(s_row, s_stride_v, lse_s, t_row, t_stride_v, lse_t, start + cols, valid,
                                            a_s, b_s, capped_s, a_t, b_t, capped_t)  # fmt: skip
            if KIND == 1:
                grad = _weighted(tl.exp(ls), ls - lt - centre) * derivative
            else:
                log_m = _log_mix(ls, lt, log_1mb, log_b)
                grad = _weighted(tl.exp(ls), ls - log_m - centre) * (derivative * (1.0 - beta))
            tl.store(s_row + (start + cols).to(tl.int64) * s_stride_v, grad, mask=valid)
    store_outputs(out_ptr, rows, row, divergence, tl.sum(entropy, axis=0), logp, lse_s, lse_t)
    tl.store(out_ptr + _CENTRE * rows + row, centre)


@triton.jit
def _token_gradient_kernel(
    s_ptr, s_stride_row, s_stride_v, t_ptr, t_stride_row, t_stride_v, targets_ptr, stats_ptr, coef_ptr,
    rows, V, a_s, b_s, capped_s, a_t, b_t, capped_t, log_1mb, log_b,
    KIND: tl.constexpr, HAS_U: tl.constexpr, HAS_G: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One row per program: the student's raw logits ← dL/dx_s of the divergence weighted by a and a token loss,
    from the row's coefficients coef [4, rows] (a, u, c0, g: `row_coefficients`) and lse_s, lse_t in stats (the
    chunk kernel's output): (p_s·(u·log p_s − c0) − a·p_t) for the forward KL, p_s·(u·log p_s − a·X − c0) with
    X = log p_t or log m for the others (HAS_U False: no u term), g added at the target (HAS_G), times dz/dx."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * s_stride_row
    t_row = t_ptr + row * t_stride_row
    lse_s = tl.load(stats_ptr + 3 * rows + row)
    lse_t = tl.load(stats_ptr + 4 * rows + row)
    a = tl.load(coef_ptr + row)
    u = tl.load(coef_ptr + rows + row)
    c0 = tl.load(coef_ptr + 2 * rows + row)
    g = tl.load(coef_ptr + 3 * rows + row)
    target = tl.load(targets_ptr + row)  # (unused without HAS_G)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        valid = start + cols < V
        ls, lt, derivative = _log_probs(s_row, s_stride_v, lse_s, t_row, t_stride_v, lse_t, start + cols, valid, a_s,
                                        b_s, capped_s, a_t, b_t, capped_t)  # fmt: skip
        ps = tl.exp(ls)
        if KIND == 0:
            if HAS_U:
                grad = _weighted(ps, u * ls - c0) - a * tl.exp(lt)
            else:
                grad = -c0 * ps - a * tl.exp(lt)
        elif KIND == 1:
            grad = _weighted(ps, u * ls - a * lt - c0)
        else:
            grad = _weighted(ps, u * ls - a * _log_mix(ls, lt, log_1mb, log_b) - c0)
        if HAS_G:
            grad += tl.where(start + cols == target, g, 0.0)
        tl.store(s_row + (start + cols).to(tl.int64) * s_stride_v, grad * derivative, mask=valid)


@triton.jit
def store_outputs(out_ptr, rows, row, divergence, entropy, logp, lse_s, lse_t):
    """A row's five outputs into out `[5, rows]` (`OUTPUTS`)."""
    tl.store(out_ptr + row, divergence)
    tl.store(out_ptr + rows + row, entropy)
    tl.store(out_ptr + 2 * rows + row, logp)
    tl.store(out_ptr + 3 * rows + row, lse_s)
    tl.store(out_ptr + 4 * rows + row, lse_t)


def scalar_arguments(zs: Tensor, zt: Tensor, spec: ChunkSpec):
    """(the heads' transforms (a_s, b_s, capped_s, a_t, b_t, capped_t), the divergence's (beta, log(1 − β), log β),
    KIND): the kernels' run-time scalars, after checking that the logits buffers are float32."""
    if zs.dtype != torch.float32 or zt.dtype != torch.float32:
        raise TypeError(f"the Triton divergence pass reads float32 logits, got {zs.dtype} and {zt.dtype}")
    beta, student, teacher = spec.beta, spec.student, spec.teacher
    a_s, b_s = transform_coefficients(spec.temperature, student.logit_scale, student.final_logit_softcapping)
    a_t, b_t = transform_coefficients(spec.temperature, teacher.logit_scale, teacher.final_logit_softcapping)
    capped_s, capped_t = student.final_logit_softcapping is not None, teacher.final_logit_softcapping is not None
    kind = kind_of(beta)
    log_1mb, log_b = (math.log1p(-beta), math.log(beta)) if kind == KINDS["jsd"] else (0.0, 0.0)
    return (a_s, b_s, capped_s, a_t, b_t, capped_t), (beta, log_1mb, log_b), kind


def divergence_chunk(
    zs: Tensor, zt: Tensor, targets: Tensor | None, spec: ChunkSpec, *, token_loss: TokenLoss | None = None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """`kernels/torch/divergence.divergence_chunk`: (divergence, entropy, logp of `targets` or None, student lse,
    teacher lse), `[c]` float32 each, from the raw float32 logits zs, zt `[c, V]` (any strides); zs is overwritten
    with dL/dx_s when `spec.with_grad` (else left as it is). One launch without `token_loss`; with it (and
    `targets`), the statistics, the loss called once with the rows' logp and entropy, then (with the gradient) its
    `TokenGradient`'s sweep: two launches."""
    scalars = scalar_arguments(zs, zt, spec)
    heads, divergence_args, kind = scalars
    rows, V = zs.shape
    out = torch.empty((CENTRE + 1, rows), dtype=torch.float32, device=zs.device)  # [6, c]
    block_v = block_v_for(V, spec.block)
    if rows:
        _divergence_chunk_kernel[(rows,)](
            zs, zs.stride(0), zs.stride(1), zt, zt.stride(0), zt.stride(1), out if targets is None else targets, out,
            rows, V, *heads, targets is not None, *divergence_args,
            KIND=kind, WITH_GRAD=spec.with_grad and token_loss is None, BLOCK_V=block_v, num_warps=NUM_WARPS,
            enable_fp_fusion=True,
        )  # fmt: skip
    divergence, entropy, logp, lse_s, lse_t, centre = out.unbind(0)
    logp = None if targets is None else logp
    if token_loss is not None:
        token = token_loss(logp, entropy)
        if spec.with_grad and rows:
            coefficients = row_coefficients(token, spec.beta, centre, entropy)
            _token_gradient_(zs, zt, token.targets, coefficients, out, scalars, block_v)
    return divergence, entropy, logp, lse_s, lse_t


def _token_gradient_(
    zs: Tensor,
    zt: Tensor,
    targets: Tensor,
    coefficients: tuple[Tensor, Tensor | None, Tensor, Tensor | None],
    stats: Tensor,
    scalars: tuple,
    block_v: int,
) -> None:
    """zs ← dL/dx_s by `_token_gradient_kernel`, from the rows' (a, u, c0, g) `[c]` (`row_coefficients`; u or g
    None: that term absent, a stands in its row), the chunk kernel's output `stats` (its lse rows) and run-time
    `scalars` (`scalar_arguments`)."""
    heads, (_, log_1mb, log_b), kind = scalars
    a, u, c0, g = coefficients
    coef = torch.stack([(a if x is None else x).to(torch.float32) for x in (a, u, c0, g)])  # [4, c]
    _token_gradient_kernel[(zs.shape[0],)](
        zs, zs.stride(0), zs.stride(1), zt, zt.stride(0), zt.stride(1), targets.contiguous(), stats, coef,
        zs.shape[0], zs.shape[1], *heads, log_1mb, log_b,
        KIND=kind, HAS_U=u is not None, HAS_G=g is not None, BLOCK_V=block_v, num_warps=NUM_WARPS,
        enable_fp_fusion=True,
    )  # fmt: skip

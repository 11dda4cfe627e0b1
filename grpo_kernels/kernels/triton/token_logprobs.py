"""Vocabulary pass in Triton: one online pass over V per token row forward, one streaming pass backward.

A row is read as tiles [BLOCK_V // VEC, VEC]: each thread owns a tile row of VEC columns (16 bytes, one vector load)
and keeps, per tile row, a running max m of v and s = Σ 2^((v − m)·k), t = Σ 2^((v − m)·k)·(v − m)·k: base 2, so that
an element costs one ex2, and v − m exact, so that a row one logit dominates gives s = 1, t = 0 exactly. The tile rows'
statistics are merged once, at the end of the row: no block-wide reduction in the loop. v is the raw logit x with
k = a·log2 e (z = a·x), or with soft-capping v = z·log2 e = b·tanh(a·x)·log2 e and k = 1; float32 whatever the input
dtype. On request the pass also folds Σ 2^(2(v − m)·k) (log Σ q²), Σ v (the mean logit) and the max of v before and
up to the target (top-1).

Main-loop loads are 16-byte vectors whatever V and the row stride: the loop streams whole tiles from the row's first
16-byte boundary (`tl.multiple_of` on the pointer holds by construction); the columns after the last whole tile (the
tail) follow in a masked tile of the same layout, and the fewer than VEC columns before the boundary (the head) in a
small one. Nothing in the main loop depends on the target: its column is loaded once, and the tile holding it (only for
`is_top1`) is folded apart, between two loops, with int32 compares. Masked rows are not read. Grid: one program per row
(64-bit offsets), or per (row, V-block) when the rows alone cannot fill the GPU (`v_splits`); the V-blocks then write
partial statistics that `_token_logprobs_merge_kernel` (or the fused loss's merge kernel) merges per row.

Backward: the same tiles and V-blocks, writing (g·(onehot − q) − g_H·q(log q + H))·dz/dx; the one-hot is tested only in
the target's tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs
from grpo_kernels.kernels.triton.row_stats import (
    EXP_FLOOR,
    FLOAT32_LOWEST,
    LOG2E,
    finish_row,
    load_tile,
    merged_stats,
    range_stats,
    row_coefficients,
    softcapped,
    tile_ptrs,
    v_of,
)

MIN_BLOCK_V = 16
_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # the optional outputs, in the kernels' order
PARTIAL_FIELDS = 8  # per (row, V-block): m, s, t, Σ e², Σ v, max v before / up to the target; v at the target (per row)

# Split-V. One program per row keeps PROGRAMS_PER_SM 8-warp programs resident per SM (48 warps: the kernels use 27 to
# 40 registers, 48 with the optional statistics); fewer rows than FILL_WAVES waves of them leave SMs idle (a
# half-empty last wave, or none after the first), so each row is then cut into V-blocks of at least MIN_SPLIT_COLUMNS
# columns (8 tiles or more, so that the partial statistics stay small against the stream), enough of them to reach
# FILL_WAVES waves. An H100 (132 SMs) splits below 1584 rows: V = 151,936 into 9 blocks at 64 rows, 2 at 1,000 rows.
# Launches off a CUDA device (the interpreter, meta tensors) plan for an H100. Tests force the split on small V by
# lowering MIN_SPLIT_COLUMNS.
PROGRAMS_PER_SM = 6
FILL_WAVES = 2
MIN_SPLIT_COLUMNS = 16384
MAX_V_SPLITS = 64
OFF_GPU_SM_COUNT = 132


def block_v_for(vocab: int, vec: int = 8) -> int:
    """Columns per tile: one VEC-wide tile row per thread of 8 warps (2048 for 2-byte logits, 1024 for float32), at
    most half of V (so that a row has whole tiles to stream), at least MIN_BLOCK_V."""
    return min(256 * vec, max(MIN_BLOCK_V, triton.next_power_of_2(vocab // 2 + 1) // 2))


def num_warps_for(block_v: int, vec: int = 8) -> int:
    return max(1, min(8, block_v // (32 * vec)))


def transform_coefficients(temperature: float, logit_scale: float, softcap: float | None) -> tuple[float, float]:
    """(a, b) with z = b·tanh(a·x) = c·tanh(s·x/c)/T when soft-capped (a = s/c, b = c/T), else z = a·x (a = s/T)."""
    if softcap is None:
        return logit_scale / temperature, 1.0
    return logit_scale / softcap, softcap / temperature


def coefficients_of(args: VocabPassArgs) -> tuple[float, float]:
    """`transform_coefficients` of a pass's record."""
    return transform_coefficients(args.temperature, args.logit_scale, args.softcap)


def v_splits(rows: int, vocab: int, sm_count: int) -> int:
    """V-blocks per row: 1 when `rows` programs fill FILL_WAVES waves of the GPU, else enough to (see above)."""
    wanted = FILL_WAVES * PROGRAMS_PER_SM * sm_count
    if rows == 0 or rows >= wanted or vocab < 2 * MIN_SPLIT_COLUMNS:
        return 1
    return min(triton.cdiv(wanted, rows), vocab // MIN_SPLIT_COLUMNS, MAX_V_SPLITS)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return OFF_GPU_SM_COUNT
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def vocab_plan(logits: Tensor) -> dict:
    """The tiling and grid of a pass over [B, T, V] logits: BLOCK_V, VEC, num_warps, V-blocks and their width."""
    B, T, V = logits.shape
    vec = 16 // logits.element_size()
    block_v = block_v_for(V, vec)
    splits = v_splits(B * T, V, sm_count(logits.device))
    chunk = V if splits == 1 else triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    return dict(block_v=block_v, vec=vec, warps=num_warps_for(block_v, vec), chunk=chunk, splits=triton.cdiv(V, chunk))


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr, stride_b, stride_t, targets_ptr, mask_ptr,
    logp_ptr, lse_ptr, entropy_ptr, sum_sq_ptr, mean_ptr, top1_ptr, partial_ptr,
    T, V, chunk, a, b,
    HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_SUM_SQ: tl.constexpr, WITH_MEAN: tl.constexpr,
    WITH_TOP1: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """One row per program; with SPLIT, one V-block of `chunk` columns per program (axis 1), which writes its partial
    statistics to partial [PARTIAL_FIELDS, rows, V-blocks] instead of the outputs."""
    row = tl.program_id(0).to(tl.int64)
    k, a2, b2 = row_coefficients(a, b, HAS_SOFTCAP)
    c0 = 0
    c1 = V
    if SPLIT:
        c0 = tl.program_id(1) * chunk
        c1 = tl.minimum(c0 + chunk, V)
    zero = tl.zeros((), tl.float32)
    out = (zero, zero, zero, zero, zero, tl.zeros((), tl.int1))
    if tl.load(mask_ptr + row) != 0:
        seq = row // T
        row_ptr = logits_ptr + seq * stride_b + (row - seq * T) * stride_t
        target = tl.load(targets_ptr + row).to(tl.int32)
        merged = range_stats(
            row_ptr, c0, c1, target, k, a2, b2, HAS_SOFTCAP, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN, WITH_TOP1,
            BLOCK_V, VEC,
        )  # fmt: skip
        if SPLIT:
            n_split = tl.num_programs(1)
            plane = tl.num_programs(0).to(tl.int64) * n_split
            for i in tl.static_range(7):
                tl.store(partial_ptr + i * plane + row * n_split + tl.program_id(1), merged[i])
            if (target >= c0) & (target < c1):
                v_t = v_of(tl.load(row_ptr + target), a2, b2, HAS_SOFTCAP)
                tl.store(partial_ptr + 7 * plane + row * n_split, v_t)
        else:
            out = finish_row(merged, v_of(tl.load(row_ptr + target), a2, b2, HAS_SOFTCAP), V, a, k, HAS_SOFTCAP)
    if not SPLIT:
        _store_row(row, out, logp_ptr, lse_ptr, entropy_ptr, sum_sq_ptr, mean_ptr, top1_ptr, WITH_ENTROPY, WITH_SUM_SQ,
                   WITH_MEAN, WITH_TOP1)  # fmt: skip


@triton.jit
def _store_row(row, out, logp_ptr, lse_ptr, entropy_ptr, sum_sq_ptr, mean_ptr, top1_ptr, WITH_ENTROPY: tl.constexpr,
               WITH_SUM_SQ: tl.constexpr, WITH_MEAN: tl.constexpr, WITH_TOP1: tl.constexpr):  # fmt: skip
    logp, lse, entropy, log_sum_sq, mean, top1 = out
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
def merged_partials(partial_ptr, row, n_split, V, a, b, HAS_SOFTCAP: tl.constexpr, SPLITS: tl.constexpr):
    """(logp, lse, entropy, log Σ q², mean z, is_top1) of a kept row from its V-blocks' partial statistics (one
    program per row)."""
    k, _, _ = row_coefficients(a, b, HAS_SOFTCAP)
    live = tl.arange(0, SPLITS) < n_split
    plane = tl.num_programs(0).to(tl.int64) * n_split
    p = partial_ptr + row * n_split + tl.arange(0, SPLITS)
    m = tl.load(p, mask=live, other=FLOAT32_LOWEST)
    s = tl.load(p + plane, mask=live, other=0.0)
    t = tl.load(p + 2 * plane, mask=live, other=0.0)
    sq = tl.load(p + 3 * plane, mask=live, other=0.0)
    vsum = tl.load(p + 4 * plane, mask=live, other=0.0)
    before = tl.load(p + 5 * plane, mask=live, other=-float("inf"))
    top = (before, tl.load(p + 6 * plane, mask=live, other=-float("inf")))
    merged = merged_stats((m, s, t, sq, vsum), top, k)
    return finish_row(merged, tl.load(partial_ptr + 7 * plane + row * n_split), V, a, k, HAS_SOFTCAP)


@triton.jit
def _token_logprobs_merge_kernel(
    partial_ptr, mask_ptr, logp_ptr, lse_ptr, entropy_ptr, sum_sq_ptr, mean_ptr, top1_ptr, n_split, V, a, b,
    HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_SUM_SQ: tl.constexpr, WITH_MEAN: tl.constexpr,
    WITH_TOP1: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    zero = tl.zeros((), tl.float32)
    out = (zero, zero, zero, zero, zero, tl.zeros((), tl.int1))
    if tl.load(mask_ptr + row) != 0:
        out = merged_partials(partial_ptr, row, n_split, V, a, b, HAS_SOFTCAP, SPLITS)
    _store_row(row, out, logp_ptr, lse_ptr, entropy_ptr, sum_sq_ptr, mean_ptr, top1_ptr, WITH_ENTROPY, WITH_SUM_SQ,
               WITH_MEAN, WITH_TOP1)  # fmt: skip


@triton.jit
def _logit_grad(x, pos, target, row_grad, HAS_SOFTCAP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
                HAS_TARGET: tl.constexpr):  # fmt: skip
    """dL/dx of a tile of raw logits x: (g·(onehot − q) − g_h·q·(log q + H))·dz/dx, row_grad = (lse, g, g_h, c_h, a, b)
    with c_h = g + g_h·H; without soft-capping g, g_h and c_h come scaled by dz/dx = a. The one-hot only where
    HAS_TARGET (pos == target)."""
    lse, g, g_h, c_h, a, b = row_grad
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        z, sech2 = softcapped(x * a, b)
        log_q = z - lse
    else:  # z = x·a rounded, as the forward's lse = z_max + …: no fma of x·a − lse (the max keeps them apart)
        log_q = tl.maximum(x * a, -float("inf")) - lse
    q = tl.math.exp2(log_q * LOG2E)
    if HAS_GRAD_ENTROPY:  # q·(g + g_h·(log q + H)); at q = 0 (log q = −inf) the clamp keeps 0·(…) = 0
        grad = -q * tl.fma(g_h, tl.maximum(log_q, EXP_FLOOR), c_h)
    else:
        grad = -q * g
    if HAS_TARGET:
        grad += tl.where(pos == target, g, 0.0)
    if HAS_SOFTCAP:
        grad *= (a * b) * sech2
    return grad


@triton.jit
def _grad_tile(p, out_p, pos, target, row_grad, HAS_SOFTCAP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
               HAS_TARGET: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """The gradient of the whole, aligned tile at p, stored at out_p."""
    x = load_tile(tile_ptrs(p, ROWS, VEC), ROWS, VEC)
    grad = _logit_grad(x, pos, target, row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY, HAS_TARGET)
    tl.store(out_p + pos, grad.to(out_p.dtype.element_ty))


@triton.jit
def _grad_masked(ptr, out_ptr, pos, n, target, row_grad, HAS_SOFTCAP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr):
    """The gradient at the n < |pos| columns at ptr + pos, stored at out_ptr + pos (target relative to ptr)."""
    x = tl.load(ptr + pos, mask=pos < n, other=0.0)
    grad = _logit_grad(x, pos, target, row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY, True)
    tl.store(out_ptr + pos, grad.to(out_ptr.dtype.element_ty), mask=pos < n)


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr, stride_b, stride_t, out_ptr, out_stride_b, out_stride_t,
    targets_ptr, mask_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    T, V, chunk, a, b,
    HAS_SOFTCAP: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    IN_PLACE: tl.constexpr, OUT_LIKE_IN: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """One (row, V-block of `chunk` columns) per program. IN_PLACE: out is the logits. OUT_LIKE_IN: every out row has
    its logits row's alignment (the same strides modulo 16 bytes), so the stores are vectors too."""
    ROWS: tl.constexpr = BLOCK_V // VEC
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * chunk
    c1 = tl.minimum(c0 + chunk, V)
    seq = row // T
    t_idx = row - seq * T
    row_ptr = logits_ptr + seq * stride_b + t_idx * stride_t
    out_row_ptr = out_ptr + seq * out_stride_b + t_idx * out_stride_t
    if IN_PLACE:
        out_row_ptr = row_ptr
    pos = tl.arange(0, ROWS)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    head = ((-(row_ptr + c0).to(tl.int64)) & 15).to(tl.int32) // (16 // VEC)  # as in `range_stats`
    n_head = tl.minimum(head, c1 - c0)
    cols = tl.arange(0, VEC)
    body = c0 + head
    n_full = tl.maximum(c1 - body, 0) // BLOCK_V
    p = tl.multiple_of(row_ptr + body, 16)
    out_p = out_row_ptr + body
    if IN_PLACE:
        out_p = p
    elif OUT_LIKE_IN:
        out_p = tl.multiple_of(out_p, 16)
    if tl.load(mask_ptr + row) != 0:
        lse = tl.load(lse_ptr + row)
        target = tl.load(targets_ptr + row).to(tl.int32)
        g = tl.zeros((), tl.float32)
        g_h = tl.zeros((), tl.float32)
        h = tl.zeros((), tl.float32)
        if HAS_GRAD_LOGP:
            g = tl.load(grad_logp_ptr + row).to(tl.float32)
        if HAS_GRAD_ENTROPY:
            g_h = tl.load(grad_entropy_ptr + row).to(tl.float32)
            h = tl.load(entropy_ptr + row)
        if not HAS_SOFTCAP:  # dz/dx = a folded into the row's coefficients
            g, g_h = g * a, g_h * a
        c_h = tl.fma(g_h, h, g)
        row_grad = (lse, g, g_h, c_h, a, b)
        n_before = tl.where(target < body, 0, tl.minimum((target - body) // BLOCK_V, n_full))
        for _ in range(0, n_before):
            _grad_tile(p, out_p, pos, target, row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY, False, ROWS, VEC)
            p += BLOCK_V
            out_p = p if IN_PLACE else out_p + BLOCK_V
        if n_before < n_full:
            tgt = target - body - n_before * BLOCK_V
            _grad_tile(p, out_p, pos, tgt, row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY, True, ROWS, VEC)
            p += BLOCK_V
            out_p = p if IN_PLACE else out_p + BLOCK_V
        for _ in range(n_before + 1, n_full):
            _grad_tile(p, out_p, pos, target, row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY, False, ROWS, VEC)
            p += BLOCK_V
            out_p = p if IN_PLACE else out_p + BLOCK_V
        tail = c1 - body - n_full * BLOCK_V
        _grad_masked(p, out_p, pos, tail, target - (c1 - tail), row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY)
        _grad_masked(row_ptr + c0, out_row_ptr + c0, cols, n_head, target - c0, row_grad, HAS_SOFTCAP, HAS_GRAD_ENTROPY)
    else:  # a masked row: 0, without reading its logits
        zeros = tl.zeros((ROWS, VEC), out_ptr.dtype.element_ty)
        for _ in range(0, n_full):
            tl.store(out_p + pos, zeros)
            out_p += BLOCK_V
        tl.store(out_p + pos, zeros, mask=pos < c1 - body - n_full * BLOCK_V)
        tl.store(out_row_ptr + c0 + cols, tl.zeros((VEC,), out_ptr.dtype.element_ty), mask=cols < n_head)


def _flags(with_entropy: bool, softcap: float | None, stats) -> dict:
    return dict(HAS_SOFTCAP=softcap is not None, WITH_ENTROPY=with_entropy, WITH_SUM_SQ="log_sum_sq_probs" in stats,
                WITH_MEAN="mean_logits" in stats, WITH_TOP1="is_top1" in stats)  # fmt: skip


def launch_partials(logits: Tensor, targets: Tensor, mask: Tensor, a: float, b: float, flags: dict, plan: dict):
    """The V-blocks' partial statistics [PARTIAL_FIELDS, B·T, V-blocks] of a split pass (targets, mask contiguous)."""
    B, T, V = logits.shape
    partial = torch.empty((PARTIAL_FIELDS, B * T, plan["splits"]), dtype=torch.float32, device=logits.device)
    _token_logprobs_fwd_kernel[(B * T, plan["splits"])](
        logits, logits.stride(0), logits.stride(1), targets, mask, *(partial,) * 7, T, V, plan["chunk"], a, b,
        **flags, SPLIT=True, BLOCK_V=plan["block_v"], VEC=plan["vec"], num_warps=plan["warps"], enable_fp_fusion=True,
    )  # fmt: skip
    return partial


def token_logprobs_fwd(args: VocabPassArgs) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """logits (last stride 1) -> logp, lse, entropy|None, [B, T] fp32, and the requested `stats` by name ([B, T];
    `is_top1` bool)."""
    logits, with_entropy = args.logits, args.with_entropy
    B, T, V = logits.shape
    targets, mask = args.targets.contiguous(), args.mask.contiguous()
    logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)  # [B, T]
    lse = torch.empty_like(logp)  # [B, T]
    entropy = torch.empty_like(logp) if with_entropy else None  # [B, T]
    out = {name: torch.empty_like(logp, dtype=torch.int8 if name == "is_top1" else None) for name in args.stats}
    outputs = (logp, lse, logp if entropy is None else entropy, *(out.get(n, logp) for n in _STATS))
    a, b = coefficients_of(args)
    flags, plan = _flags(with_entropy, args.softcap, out), vocab_plan(logits)
    if plan["splits"] == 1:
        _token_logprobs_fwd_kernel[(B * T,)](
            logits, logits.stride(0), logits.stride(1), targets, mask, *outputs, logp, T, V, V, a, b, **flags,
            SPLIT=False, BLOCK_V=plan["block_v"], VEC=plan["vec"], num_warps=plan["warps"], enable_fp_fusion=True,
        )  # fmt: skip
    else:
        partial = launch_partials(logits, targets, mask, a, b, flags, plan)
        _token_logprobs_merge_kernel[(B * T,)](
            partial, mask, *outputs, plan["splits"], V, a, b, **flags,
            SPLITS=triton.next_power_of_2(plan["splits"]), num_warps=1, enable_fp_fusion=True,
        )  # fmt: skip
    if "is_top1" in out:
        out["is_top1"] = out["is_top1"].bool()
    return logp, lse, entropy, out


def _same_rows(out: Tensor, logits: Tensor) -> bool:
    """Whether `out` is the logits, row for row (the in-place backward)."""
    return out.data_ptr() == logits.data_ptr() and out.stride()[:2] == logits.stride()[:2]


def _same_alignment(out: Tensor, logits: Tensor) -> bool:
    """Whether every [b, t] row of `out` starts at the same address modulo 16 bytes as that of `logits`."""
    size = logits.element_size()
    steps = [(o - i) * size for o, i in zip(out.stride()[:2], logits.stride()[:2], strict=True)]
    return all(d % 16 == 0 for d in (out.data_ptr() - logits.data_ptr(), *steps))


def token_logprobs_bwd(args: VocabPassArgs, grads: RowGrads, out: Tensor) -> None:
    """Write dL/dlogits into `out` (may be the logits themselves; last strides 1); masked rows get 0."""
    logits, lse, entropy = args.logits, grads.lse, grads.entropy
    B, T, V = logits.shape
    targets, mask = args.targets.contiguous(), args.mask.contiguous()
    grad_logp = None if grads.grad_logp is None else grads.grad_logp.contiguous()
    grad_entropy = None if grads.grad_entropy is None else grads.grad_entropy.contiguous()
    a, b = coefficients_of(args)
    plan = vocab_plan(logits)
    _token_logprobs_bwd_kernel[(B * T, plan["splits"])](
        logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1), targets, mask, lse,
        lse if entropy is None else entropy, lse if grad_logp is None else grad_logp,
        lse if grad_entropy is None else grad_entropy, T, V, plan["chunk"], a, b,
        HAS_SOFTCAP=args.softcap is not None, HAS_GRAD_LOGP=grad_logp is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None, IN_PLACE=_same_rows(out, logits),
        OUT_LIKE_IN=_same_alignment(out, logits), BLOCK_V=plan["block_v"], VEC=plan["vec"], num_warps=plan["warps"],
        enable_fp_fusion=True,
    )  # fmt: skip

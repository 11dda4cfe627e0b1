"""The per-row statistics of the Triton vocabulary pass, shared by its kernels (`token_logprobs.py`) and the fused
loss (`grpo_loss.py`): a row read as tiles, each tile folded into running statistics (max, Σ 2^((v − m)·k), its
t-weighted sum, and on request Σ e², Σ v, the top-1 flags), the tile rows merged once at the row's end, and the
row's logp, lse and entropy finished from them (the algorithm: `token_logprobs.py`'s module doc)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_INTERPRETING = tl.constexpr(triton.knobs.runtime.interpret)  # as @triton.jit decides, when this module is imported
FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)  # running max start: finite, so never −inf − (−inf)
EXP_FLOOR = tl.constexpr(-256.0)  # e^x and 2^x are 0 in float32 below it: clamping there keeps 0·x finite at x = −inf


@triton.jit
def reciprocal(x):
    """1/x as one approximate reciprocal (rcp.approx.ftz.f32, 1 ulp): the code `tl.math.fdiv(1, x, approx=True)` gives,
    on every supported triton (that keyword is new in 3.9; a plain division costs a range check, +25% main-loop
    instructions in the soft-capped forward). Exact division under the interpreter, which runs no PTX."""
    if _INTERPRETING:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return r


@triton.jit
def softcapped(y, b):
    """(b·tanh(y), 1 − tanh²(y)) from one exp: tanh|y| = (1 − e)/(1 + e) and sech² y = 4e/(1 + e)², e = e^(−2|y|),
    which keeps its relative precision where 1 − tanh² y would cancel; an approximate reciprocal (1 ulp)."""
    e = tl.math.exp2(tl.abs(y) * (-2.0 * LOG2E))
    r = reciprocal(1.0 + e)
    tanh_abs = (1.0 - e) * r
    return b * tl.where(y < 0, -tanh_abs, tanh_abs), 4.0 * e * r * r


@triton.jit
def v_of(x, a2, b2, HAS_SOFTCAP: tl.constexpr):
    """v of raw logits x: x, or b2·tanh(y) = b2 − 2·b2/(1 + e^(2y)), e^(2y) = 2^(a2·x) (a2 = 2a·log2 e, b2 = b·log2 e):
    one ex2 and one approximate reciprocal, |error| ~1e-7·b2; ±inf give ±b2."""
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        x = b2 - 2.0 * b2 * reciprocal(1.0 + tl.math.exp2(x * a2))
    return x


@triton.jit
def tile_ptrs(p, ROWS: tl.constexpr, VEC: tl.constexpr):
    """The pointers of the whole, 16-byte aligned tile [ROWS, VEC] at p; for bf16, [ROWS, VEC // 2] uint32 pairs."""
    if p.dtype.element_ty == tl.bfloat16:
        pairs = tl.arange(0, ROWS)[:, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, :]
        ptrs = tl.multiple_of(p.to(tl.pointer_type(tl.uint32)), 16) + pairs
    else:
        ptrs = p + tl.arange(0, ROWS)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    return ptrs


@triton.jit
def load_tile(ptrs, ROWS: tl.constexpr, VEC: tl.constexpr):
    """The tile at `tile_ptrs`. bf16 is loaded as uint32 pairs and widened by one shift or one mask each (its convert
    costs an extract and a shift for the high half); the element order is kept."""
    if ptrs.dtype.element_ty == tl.uint32:
        u = tl.load(ptrs)
        lo = (u << 16).to(tl.float32, bitcast=True)  # element 2j: the low half of pair j
        hi = (u & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.join(lo, hi).reshape(ROWS, VEC)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _next_tile(ptrs, BLOCK_V: tl.constexpr):
    if ptrs.dtype.element_ty == tl.uint32:
        ptrs += BLOCK_V // 2
    else:
        ptrs += BLOCK_V
    return ptrs


@triton.jit
def _fold(v, v_mean, st, k, WITH_ENTROPY: tl.constexpr, WITH_SUM_SQ: tl.constexpr, WITH_MEAN: tl.constexpr):
    """Fold a tile v [ROWS, VEC] (masked entries −inf; v_mean: 0 there) into its tile rows' statistics
    st = (m, s, t, Σ e², Σ v): m, s, t, Σ e² [ROWS], relative to m; Σ v [ROWS], or [ROWS, VEC] for float32 logits
    (`_mean_start`)."""
    m, s, t, sq, vsum = st
    m_new = tl.maximum(m, tl.max(v, axis=1))
    dm = (m - m_new) * k
    scale = tl.math.exp2(dm)
    d = (v - m_new[:, None]) * k  # an exact difference: 0 at the max, so one dominating logit gives s = 1, t = 0
    e = tl.math.exp2(d)
    if WITH_ENTROPY:
        t = scale * tl.fma(s, tl.maximum(dm, EXP_FLOOR), t) + tl.sum(e * tl.maximum(d, EXP_FLOOR), axis=1)
    if WITH_SUM_SQ:
        sq = sq * (scale * scale) + tl.sum(e * e, axis=1)
    if WITH_MEAN:
        if len(vsum.shape) == 2:
            vsum += v_mean
        else:
            vsum += tl.sum(v_mean, axis=1)
    return m_new, s * scale + tl.sum(e, axis=1), t, sq, vsum


@triton.jit
def _fold_top1(v, pos, target, top):
    """(max v before the target, max v up to it) of tile rows, after a tile whose columns are pos (int32 compares)."""
    before, upto = top
    before = tl.maximum(before, tl.max(tl.where(pos < target, v, -float("inf")), axis=1))
    return before, tl.maximum(upto, tl.max(tl.where(pos <= target, v, -float("inf")), axis=1))


@triton.jit
def _fold_masked(ptr, pos, n, target, stats, k, a2, b2, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                 WITH_SUM_SQ: tl.constexpr, WITH_MEAN: tl.constexpr, WITH_TOP1: tl.constexpr):  # fmt: skip
    """Fold the n < |pos| columns at ptr + pos (pos: their offsets, int32; target relative to ptr)."""
    valid = pos < n
    v = v_of(tl.load(ptr + pos, mask=valid, other=-float("inf")), a2, b2, HAS_SOFTCAP)
    if HAS_SOFTCAP:
        v = tl.where(valid, v, -float("inf"))  # the padding's tanh(−inf) = −1 must not count
    st, top = stats
    st = _fold(v, tl.where(valid, v, 0.0), st, k, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN)
    if WITH_TOP1:
        top = _fold_top1(v, pos, target, top)
    return st, top


@triton.jit
def range_stats(row_ptr, c0, c1, target, k, a2, b2, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                 WITH_SUM_SQ: tl.constexpr, WITH_MEAN: tl.constexpr, WITH_TOP1: tl.constexpr, BLOCK_V: tl.constexpr,
                 VEC: tl.constexpr):  # fmt: skip
    """The merged statistics (`merged_stats`) of columns [c0, c1) of a row."""
    ROWS: tl.constexpr = BLOCK_V // VEC
    pos = tl.arange(0, ROWS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [ROWS, VEC] column in a tile, int32
    ninf = tl.full((ROWS,), -float("inf"), tl.float32)
    zero = tl.zeros((ROWS,), tl.float32)
    st = (tl.full((ROWS,), FLOAT32_LOWEST, tl.float32), zero, zero, zero, _mean_start(row_ptr, ROWS, VEC))
    top = (ninf, ninf)
    head = ((-(row_ptr + c0).to(tl.int64)) & 15).to(tl.int32) // (16 // VEC)  # columns before a 16-byte boundary
    body = c0 + head  # that boundary (past c1 in a range shorter than the head)
    n_full = tl.maximum(c1 - body, 0) // BLOCK_V
    ptrs = tile_ptrs(tl.multiple_of(row_ptr + body, 16), ROWS, VEC)
    n_before = n_full  # whole tiles before the one holding the target (all of them unless top-1 is asked)
    if WITH_TOP1:
        n_before = tl.where(target < body, 0, tl.minimum((target - body) // BLOCK_V, n_full))
    for _ in range(0, n_before):
        v = v_of(load_tile(ptrs, ROWS, VEC), a2, b2, HAS_SOFTCAP)
        st = _fold(v, v, st, k, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN)
        ptrs = _next_tile(ptrs, BLOCK_V)
    if WITH_TOP1:
        top = (st[0], st[0])
        if n_before < n_full:
            v = v_of(load_tile(ptrs, ROWS, VEC), a2, b2, HAS_SOFTCAP)
            st = _fold(v, v, st, k, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN)
            top = _fold_top1(v, pos, target - body - n_before * BLOCK_V, top)
            ptrs = _next_tile(ptrs, BLOCK_V)
        for _ in range(n_before + 1, n_full):
            v = v_of(load_tile(ptrs, ROWS, VEC), a2, b2, HAS_SOFTCAP)
            st = _fold(v, v, st, k, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN)
            ptrs = _next_tile(ptrs, BLOCK_V)
    # the tail (fewer than BLOCK_V columns after the whole tiles, aligned: the main tiles' layout) in a masked tile,
    # the head (fewer than VEC columns) in a [1, VEC] one, merged with the rest as scalars
    tail = body + n_full * BLOCK_V
    st, top = _fold_masked(
        tl.multiple_of(row_ptr + tail, 16), pos, c1 - tail, target - tail, (st, top), k, a2, b2,
        HAS_SOFTCAP, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN, WITH_TOP1,
    )  # fmt: skip
    ninf, zero = tl.full((1,), -float("inf"), tl.float32), tl.zeros((1,), tl.float32)
    rest = (tl.full((1,), FLOAT32_LOWEST, tl.float32), zero, zero, zero, _mean_start(row_ptr, 1, VEC))
    rest = _fold_masked(
        row_ptr + c0, tl.arange(0, VEC)[None, :], tl.minimum(head, c1 - c0), target - c0, (rest, (ninf, ninf)),
        k, a2, b2, HAS_SOFTCAP, WITH_ENTROPY, WITH_SUM_SQ, WITH_MEAN, WITH_TOP1,
    )  # fmt: skip
    return _merged_pair(merged_stats(_summed_mean(st), top, k), merged_stats(_summed_mean(rest[0]), rest[1], k), k)


@triton.jit
def _mean_start(row_ptr, ROWS: tl.constexpr, VEC: tl.constexpr):
    """Σ v's start: [ROWS], or for float32 logits [ROWS, VEC], summed over VEC after the loops (`_summed_mean`). A
    tile's sum added to a loop-carried [ROWS] is what triton 3.6 and 3.7's thread-locality pass rewrites this way where
    the tile is a plain load (float32), and that pass fails once the top-1 loops follow."""
    if row_ptr.dtype.element_ty == tl.float32:
        vsum = tl.zeros((ROWS, VEC), tl.float32)
    else:
        vsum = tl.zeros((ROWS,), tl.float32)
    return vsum


@triton.jit
def _summed_mean(st):
    """`_fold`'s statistics with Σ v [ROWS], as the others."""
    m, s, t, sq, vsum = st
    if len(vsum.shape) == 2:
        vsum = tl.sum(vsum, axis=1)
    return m, s, t, sq, vsum


@triton.jit
def merged_stats(st, top, k):
    """(M, S, T, Σ e², Σ v, max before, max up to the target) of a row from its parts' (the tile rows of a program,
    or the V-blocks of a row), S, T, Σ e² relative to M."""
    m, s, t, sq, vsum = st
    M = tl.max(m, axis=0)
    dm = (m - M) * k
    f = tl.math.exp2(dm)
    T = tl.sum(tl.where(s > 0, f * tl.fma(s, dm, t), 0.0), axis=0)
    SQ = tl.sum(sq * f * f, axis=0)
    return M, tl.sum(s * f, axis=0), T, SQ, tl.sum(vsum, axis=0), tl.max(top[0], axis=0), tl.max(top[1], axis=0)


@triton.jit
def _merged_pair(x, y, k):
    """`merged_stats` of two parts given as merged statistics."""
    st = (tl.join(x[0], y[0]), tl.join(x[1], y[1]), tl.join(x[2], y[2]), tl.join(x[3], y[3]), tl.join(x[4], y[4]))
    return merged_stats(st, (tl.join(x[5], y[5]), tl.join(x[6], y[6])), k)


@triton.jit
def finish_row(merged, v_t, V, a, k, HAS_SOFTCAP: tl.constexpr):
    """(logp, lse, entropy, log Σ q², mean z, is_top1) of a row from its merged statistics and v at the target."""
    M, S, T, SQ, VSUM, BEFORE, UPTO = merged
    log2_s = tl.log2(S)
    logp = ((v_t - M) * k - log2_s) * LN2
    if HAS_SOFTCAP:
        lse = (M + log2_s) * LN2
        mean = VSUM * LN2 / V
    else:  # z_max + log Σ e^(z − z_max): exactly z_max where one logit dominates, as the backward's q = 1 needs
        lse = M * a + log2_s * LN2
        mean = VSUM * a / V
    entropy = (log2_s - T / S) * LN2
    log_sum_sq = (tl.log2(SQ) - 2.0 * log2_s) * LN2
    return logp, lse, entropy, log_sum_sq, mean, (UPTO >= M) & (BEFORE < UPTO)


@triton.jit
def row_coefficients(a, b, HAS_SOFTCAP: tl.constexpr):
    """(k, a2, b2) of `_fold` and `v_of` for the transform (a, b)."""
    if HAS_SOFTCAP:
        return tl.full((), 1.0, tl.float32), a * (2.0 * LOG2E), b * LOG2E
    return a * LOG2E, a, b


@triton.jit
def row_logprob_stats(row_ptr, target, V, a, b, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                      BLOCK_V: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """(logp of `target` (int32), lse, entropy) of one whole row."""
    k, a2, b2 = row_coefficients(a, b, HAS_SOFTCAP)
    merged = range_stats(row_ptr, 0, V, target, k, a2, b2, HAS_SOFTCAP, WITH_ENTROPY, False, False, False, BLOCK_V, VEC)
    v_t = v_of(tl.load(row_ptr + target), a2, b2, HAS_SOFTCAP)
    logp, lse, entropy, _, _, _ = finish_row(merged, v_t, V, a, k, HAS_SOFTCAP)
    return logp, lse, entropy

"""The two-head divergence near the memory floor (`memory="lean"`, torch backend): tiles of rows × vocabulary columns
and a vocabulary-major backward, as the lean fused lm_head does it.

Forward, per tile of rows: two sweeps over the vocabulary tiles, each tile's logits from one GEMM per head: the heads'
log-sum-exps (merged across the tiles), then the divergence, the entropy and the log-prob of the targets
(`DivergenceSums`); only `[M]` statistics are kept. Backward, per vocabulary tile: each row tile's logits are computed
again and turned into dL/dx_s (`student_gradient_`), which gives dH (accumulated in float32) and that tile's dW and db,
written once, in the weight's dtype. 4 GEMMs forward and 4 backward (the row-chunked route: 4 in all), for no
`[rows, V]` buffer and no float32 `[V, H]` accumulator beside a bf16/fp16 dW: the extra memory is dW + dH (+ dH in
float32 for bf16/fp16) + one tile (its two logits, the temporaries of its math, and a float32 dW tile where the rows
take several tiles or the weight is bf16/fp16).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.torch.divergence import DivergenceSums, student_gradient_, transform_

TILE_BYTES = {"cpu": 32 << 20, "cuda": 64 << 20}  # the two heads' [rows, columns] logits of one tile
TILE_ROWS = {"cpu": 2048, "cuda": 16384}  # rows per tile at most: the GEMMs stay large in rows, V is cut first
TILE_ALIGN = 128


def plan_tile(rows: int, vocab: int, device: torch.device, tile: tuple[int | None, int | None]) -> tuple[int, int]:
    """(rows, columns) of a tile: each side of `tile` where given, else as many rows as TILE_ROWS allows and the
    columns that fit both heads' float32 logits in TILE_BYTES (a multiple of TILE_ALIGN, at least TILE_ALIGN)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    r = max(1, min(rows, tile[0] or TILE_ROWS[kind]))
    columns = tile[1] or max(TILE_ALIGN, TILE_BYTES[kind] // (2 * 4 * r) // TILE_ALIGN * TILE_ALIGN)
    return r, max(1, min(vocab, columns))


def _spans(n: int, step: int):
    for start in range(0, n, step):
        yield slice(start, min(start + step, n))


class _Heads:
    """Both heads' inputs, and one tile's logits of each, transformed (z = c·tanh(s·x/c)/T), in the compute dtype."""

    def __init__(self, student: tuple, teacher: tuple, opts, dtype: torch.dtype):
        self.student, self.teacher, self.opts, self.dtype = student, teacher, opts, dtype

    def logits(self, rows: slice, cols: slice) -> tuple[Tensor, Tensor]:
        """(z_s, z_t) `[r, w]` of the rows and vocabulary columns."""
        out = []
        for (hidden, weight, bias), head in ((self.student, self.opts.student), (self.teacher, self.opts.teacher)):
            h, w = hidden[rows].to(self.dtype), weight[cols].to(self.dtype)
            z = h @ w.T if bias is None else torch.addmm(bias[cols].to(self.dtype), h, w.T)
            transform_(z, head, self.opts.temperature)
            out.append(z)
        return out[0], out[1]


def _statistics(heads: _Heads, rows: slice, V: int, columns: int) -> tuple[Tensor, Tensor, Tensor]:
    """(lse_s, lse_t `[r, 1]`, the smallest transformed logit of both heads (0-d)) of the rows, tile by tile."""
    lse_s, lse_t, lows = [], [], []
    for cols in _spans(V, columns):
        zs, zt = heads.logits(rows, cols)
        lse_s.append(torch.logsumexp(zs, -1))
        lse_t.append(torch.logsumexp(zt, -1))
        lows.append(torch.minimum(zs.amin(), zt.amin()))
    merged = (torch.logsumexp(torch.stack(parts, -1), -1, keepdim=True) for parts in (lse_s, lse_t))
    return *merged, torch.stack(lows).amin()


def _log_probs(heads: _Heads, rows: slice, cols: slice, lse_s: Tensor, lse_t: Tensor) -> tuple[Tensor, Tensor]:
    zs, zt = heads.logits(rows, cols)
    return zs.sub_(lse_s), zt.sub_(lse_t)


class LeanDivergenceFunction(torch.autograd.Function):
    """`divergence._FusedLinearDivergenceFunction`'s inputs and outputs (no top-k), on tiles."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, targets, topk_ids, opts, grad_enabled):
        dtype = compute_dtype(s_weight.dtype)
        heads = _Heads((s_hidden, s_weight, s_bias), (t_hidden, t_weight, t_bias), opts, dtype)
        M, V = s_hidden.shape[0], s_weight.shape[0]
        r, columns = plan_tile(M, V, s_hidden.device, opts.tile)
        names = ("divergence", "entropy", "logp", "lse_s", "lse_t", "centre")
        outs = {name: s_hidden.new_zeros(M, dtype=dtype) for name in names}
        exact = True  # no -inf logit in any tile: no 0·log 0 to mask in the backward either
        for rows in _spans(M, r):
            backends.count_launch(opts.backend)
            lse_s, lse_t, low = _statistics(heads, rows, V, columns)
            rows_exact = not bool(torch.isneginf(low))
            exact = exact and rows_exact
            sums = DivergenceSums.zeros(rows.stop - rows.start, lse_s)
            for cols in _spans(V, columns):
                ls, lt = _log_probs(heads, rows, cols, lse_s, lse_t)
                sums.fold(ls, lt, opts.beta, rows_exact)
                if targets is not None:
                    _gather_targets(outs["logp"][rows], ls, targets[rows], cols)
            divergence, centre = sums.finish(opts.beta)
            values = (divergence, sums.entropy, None, lse_s[:, 0], lse_t[:, 0], centre)
            for name, value in zip(names, values, strict=True):
                if value is not None:  # logp: gathered tile by tile
                    outs[name][rows] = value
        ctx.opts, ctx.tile, ctx.exact = opts, (r, columns), exact
        ctx.needs = tuple(grad_enabled and need for need in ctx.needs_input_grad[:3])
        ctx.save_for_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, outs["lse_s"], outs["lse_t"],
                              outs["centre"])  # fmt: skip
        logp = outs["logp"] if targets is not None else s_hidden.new_empty((0,), dtype=dtype)
        details = (outs["divergence"], outs["entropy"], logp, outs["lse_s"], outs["lse_t"])
        ids = s_hidden.new_empty((0,), dtype=torch.long)
        ctx.mark_non_differentiable(*details, ids)
        return outs["divergence"].sum(), *details, ids

    @staticmethod
    def backward(ctx, grad_total, *_details):
        if grad_total is None or not any(ctx.needs):
            return (None,) * 10
        *inputs, lse_s, lse_t, centre = ctx.saved_tensors
        heads = _Heads(tuple(inputs[:3]), tuple(inputs[3:]), ctx.opts, lse_s.dtype)
        lse_s, lse_t, centre = lse_s[:, None], lse_t[:, None], centre[:, None]  # [M, 1] each
        grads = _student_gradients(heads, lse_s=lse_s, lse_t=lse_t, centre=centre, scale=grad_total, tile=ctx.tile,
                                   exact=ctx.exact, needs=ctx.needs)  # fmt: skip
        return (*grads, *(None,) * 7)


def _gather_targets(logp: Tensor, ls: Tensor, targets: Tensor, cols: slice) -> None:
    """logp[i] ← ls[i, targets[i] − cols.start] where the target falls in the tile's columns."""
    inside = (targets >= cols.start) & (targets < cols.stop)
    at = (targets - cols.start).clamp(0, ls.shape[1] - 1)
    logp.copy_(torch.where(inside, ls.gather(1, at[:, None])[:, 0], logp))


def _student_gradients(heads: _Heads, *, lse_s, lse_t, centre, scale, tile, exact, needs) -> list[Tensor | None]:
    """dH, dW, db (those `needs` asks for) of Σ divergence times `scale`, vocabulary tile by vocabulary tile, from the
    rows' statistics `[M, 1]`."""
    (hidden, weight, bias), opts, dtype = heads.student, heads.opts, heads.dtype
    M, V = hidden.shape[0], weight.shape[0]
    r, columns = tile
    d_hidden = hidden.new_zeros(hidden.shape, dtype=dtype) if needs[0] else None
    d_weight = weight.new_empty(weight.shape) if needs[1] else None
    d_bias = bias.new_empty(bias.shape) if needs[2] else None
    spec = dataclasses.replace(opts.chunk_spec(True, hidden.device), block=columns)  # a tile's columns in one block
    in_place = d_weight is not None and weight.dtype == dtype and r >= M > 0  # one GEMM per tile straight into dW
    scale = scale.to(dtype)
    for cols in _spans(V, columns):
        w = weight[cols].to(dtype)
        d_w = d_weight[cols] if in_place else None
        if d_weight is not None and not in_place:
            d_w = w.new_zeros(w.shape)
        d_b = None if d_bias is None else w.new_zeros(cols.stop - cols.start)
        for rows in _spans(M, r):
            ls, lt = _log_probs(heads, rows, cols, lse_s[rows], lse_t[rows])
            student_gradient_(ls, lt, centre=centre[rows, 0], lse_s=lse_s[rows], spec=spec, exact=exact)
            grad = ls.mul_(scale)  # [r, w]: dL/dx_s of the tile
            if d_hidden is not None:
                d_hidden[rows].addmm_(grad, w)
            if d_w is not None:
                h = hidden[rows].to(dtype)
                torch.mm(grad.T, h, out=d_w) if in_place else d_w.addmm_(grad.T, h)
            if d_b is not None:
                d_b += grad.sum(0)
        if d_weight is not None and not in_place:
            d_weight[cols] = d_w
        if d_bias is not None:
            d_bias[cols] = d_b
    return [None if d_hidden is None else d_hidden.to(hidden.dtype), d_weight, d_bias]

"""The fused lm_head at the memory floor (`memory="lean"`): 2-D tiles and a vocabulary-major backward.

Forward: per tile of rows, each vocabulary tile's logits [rows, vocab] come from one GEMM and are folded into the rows'
running statistics (an online log-sum-exp across vocabulary tiles); only O(M) statistics are kept. Backward: per
vocabulary tile, each row tile's logits are computed again (the 4th GEMM), overwritten by dL/dlogits, and give dH
(accumulated in float32 over the vocabulary tiles) and that tile's dW, written once, in the weight's dtype: with one
row tile, one GEMM over all rows straight into dW; with several, summed in a [vocab, H] float32 tile for bf16/fp16
weights. No [V, H] float32 buffer exists, so the extra memory is dW + dH (+ dH in float32 for bf16/fp16) + one tile.
A `head_precision` other than the weight's dtype casts each tile's slice of the weight for its logits GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels import head_precision
from grpo_kernels.kernels.fused_linear import accumulate, gemm_mode, named_outputs
from grpo_kernels.kernels.logits_driver import checked_rows
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import RowGrads, compute_dtype

# Tile budget: the [rows, vocab] logits in the weight's dtype (plus their float32 copy where `gemm_mode` upcasts, and
# the [vocab, H] float32 dW tile for bf16/fp16 when the rows take several tiles). CPU: 32 MiB (the CPU bar, extra
# memory ≤ 1.15× dW + dH at N = 2,048, H = 896, V = 151,936 fp32, leaves ~79 MiB); CUDA: 64 MiB, at most 1/16 of
# free memory.
CPU_TILE_BYTES = 32 << 20
CUDA_TILE_BYTES = 64 << 20
TILE_ROWS = {"cpu": 2048, "cuda": 16384}  # rows per tile at most: the GEMMs stay large in rows, V is cut first
MIN_TILE = 128  # the smallest tile is min(N, 128) rows × min(V, 128) columns, whatever the budget
TILE_VOCAB_ALIGN = 128
CAST_ROWS = 1024  # rows per block of the in-place float32 -> bf16/fp16 cast of dH


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The tiles of a lean pass over N rows × V columns: `rows` × `columns` each, `tiles` of them per pass (forward
    and backward alike), and the `bytes` of the buffers one tile needs (see `tile_bytes`)."""

    rows: int
    columns: int
    bytes: int
    tiles: int


def tile_bytes(rows: int, columns: int, n: int, hidden: int, dtype: torch.dtype, upcast: bool) -> int:
    """The buffers of one tile: its logits [rows, columns] in `dtype` (+ a float32 copy when the GEMMs `upcast`
    bf16/fp16), and for bf16/fp16 weights whose N rows take several tiles, the float32 dW tile [columns, H]."""
    low = dtype.itemsize < 4
    per_element = dtype.itemsize + (4 if upcast and low else 0)
    return rows * columns * per_element + (columns * 4 * hidden if low and rows < n else 0)


def plan_tiles(
    n: int, vocab: int, hidden: int, dtype: torch.dtype, budget: int, max_rows: int, upcast: bool
) -> TilePlan:
    """The tile for N rows, V columns, H hidden within `budget` bytes: up to `max_rows` rows and as many columns (a
    multiple of 128) as fit; columns shrink first, to min(V, 128), then rows, to min(N, 128) (a multiple of 128 below
    N). Never smaller: if even that tile exceeds the budget it is taken, and a warning names both figures (once)."""
    min_rows, min_columns = max(1, min(n, MIN_TILE)), max(1, min(vocab, MIN_TILE))
    rows = max(min_rows, min(n, max_rows))
    per_column = tile_bytes(rows, 1, n, hidden, dtype, upcast)
    columns = vocab if budget // per_column >= vocab else budget // per_column // TILE_VOCAB_ALIGN * TILE_VOCAB_ALIGN
    if columns < min_columns:  # then the rows: the float32 dW tile, if any, is fixed by the columns
        columns = min_columns
        fixed = tile_bytes(0, columns, n, hidden, dtype, upcast)
        rows = min(rows, max(0, budget - fixed) // max(1, tile_bytes(1, columns, n, hidden, dtype, upcast) - fixed))
        rows = rows if rows >= n else rows // MIN_TILE * MIN_TILE
        rows = max(rows, min_rows)
    need = tile_bytes(rows, columns, n, hidden, dtype, upcast)
    if need > budget:
        _warn_over_budget(need, budget)
    return TilePlan(rows, columns, need, -(-n // rows) * -(-vocab // columns))


@functools.cache
def _warn_over_budget(need: int, budget: int) -> None:
    warnings.warn(
        f"memory='lean': the smallest tile (min(N, {MIN_TILE}) rows × min(V, {MIN_TILE}) columns) needs {need:,} bytes "
        f"of buffers, over the tile budget of {budget:,} bytes; it is used anyway (smaller tiles would be too slow)",
        stacklevel=4,
    )


def tile_budget(device: torch.device) -> int:
    """Bytes a tile's buffers may take on `device`: CPU_TILE_BYTES; CUDA: CUDA_TILE_BYTES, at most 1/16 of the free
    memory (not asked inside a CUDA graph capture)."""
    if device.type != "cuda":
        return CPU_TILE_BYTES
    free = 1 << 34 if torch.cuda.is_current_stream_capturing() else torch.cuda.mem_get_info(device)[0]
    return min(CUDA_TILE_BYTES, free // 16)


def tile_shape(rows: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, tile) -> tuple[int, int]:
    """(rows, vocab) of a tile: `tile` (cut to the problem), else `plan_tiles` within `tile_budget(device)`."""
    if tile is not None:
        return max(1, min(tile[0], rows)), max(1, min(tile[1], vocab))
    max_rows = TILE_ROWS["cuda" if device.type == "cuda" else "cpu"]
    upcast = gemm_mode(device) == "upcast"
    plan = plan_tiles(rows, vocab, hidden, dtype, tile_budget(device), max_rows, upcast)
    return plan.rows, plan.columns


def _tiles(n: int, step: int):
    for start in range(0, n, step):
        yield slice(start, min(start + step, n))


def _tile_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, *, buffer: Tensor, precision: str) -> Tensor:
    """hidden [c, H] @ weight[v].T (+ bias[v]) as a contiguous [c, w] view of `buffer` (one buffer for every tile),
    in the buffer's dtype: `precision`'s (`head_precision`), the tile of the weight cast to it here."""
    out = buffer[: hidden.shape[0] * weight.shape[0]].view(hidden.shape[0], weight.shape[0])
    weight, bias = head_precision.operands(weight, bias, precision)
    return head_precision.logits_gemm(hidden, weight, bias, out=out, head_precision=precision)


def _tile_pass(backend: str):
    """The module with `TileStats` and `tile_grad_` for `backend`."""
    return backends.kernels_of(backend, "tile_module")


def cast_in_place(acc: Tensor, dtype: torch.dtype) -> Tensor:
    """acc [M, H] float32 as `dtype` (2 bytes) in acc's own storage, block by block (each block read into a temporary
    before its values are written over rows already read): no second [M, H] buffer."""
    M, H = acc.shape
    out = acc.view(-1).view(dtype)[: M * H]
    for rows in _tiles(M, CAST_ROWS):
        out[rows.start * H : rows.stop * H].copy_(acc[rows].to(dtype).view(-1))
    return out.view(M, H)


class _LeanLinearLogprobsFunction(torch.autograd.Function):
    """`fused_linear`'s log-probs on 2-D tiles, its own schedule: (hidden [M, H], weight [V, H], bias [V] | None,
    targets [M], row_mask [M] | None) -> logp [M], entropy [M] or empty, each asked statistic [M]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, opts):
        tiles = _tile_pass(opts.backend)
        M, (V, H) = targets.shape[0], weight.shape
        rows, vocab = tile_shape(M, V, H, weight.dtype, hidden.device, opts.tile)
        dtype = head_precision.logits_dtype(opts.head_precision, weight.dtype)
        buffer = weight.new_empty(rows * vocab, dtype=dtype)
        logps, lses, entropies, stats = [], [], [], {name: [] for name in opts.stats}
        for r in _tiles(M, rows):
            running = tiles.TileStats(targets[r], None if row_mask is None else row_mask[r], dtype, opts)
            h_r = head_precision.cast(hidden[r], dtype)
            for v in _tiles(V, vocab):
                backends.count_launch(opts.backend)
                z = _tile_logits(
                    h_r, weight[v], None if bias is None else bias[v], buffer=buffer, precision=opts.head_precision
                )
                running.add(z, v.start)
            logp, lse, entropy, tile_stats = running.finish(V)
            logps.append(logp)
            lses.append(lse)
            entropies.append(entropy if opts.with_entropy else logp.new_empty(0))
            for name, acc in stats.items():
                acc.append(tile_stats[name])
        cat = lambda parts, dtype=torch.float32: torch.cat(parts) if parts else hidden.new_empty(0, dtype=dtype)  # noqa: E731
        logp, lse, entropy = cat(logps), cat(lses), cat(entropies)  # [M] each
        logp = checked_rows(opts.row_check, lse, logp, row_mask)
        stats = [cat(acc, torch.bool if name == "is_top1" else torch.float32) for name, acc in stats.items()]
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets, row_mask, lse, entropy)
        ctx.opts, ctx.tile = opts, (rows, vocab)
        return logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_stats):
        hidden, weight, bias, targets, row_mask, lse, entropy = ctx.saved_tensors
        opts, (rows, vocab) = ctx.opts, ctx.tile
        tiles = _tile_pass(opts.backend)
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        M, (V, H) = targets.shape[0], weight.shape
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if not opts.with_entropy:
            grad_entropy = None
        read_entropy = None if grad_entropy is None else entropy
        grads = RowGrads(lse=lse, entropy=read_entropy, grad_logp=grad_logp, grad_entropy=grad_entropy)  # [M] each
        mode = gemm_mode(weight.device)
        acc_dtype = compute_dtype(weight.dtype)
        d_hidden = torch.zeros(M, H, dtype=acc_dtype, device=hidden.device) if needs_h else None  # [M, H]
        new = torch.zeros if M == 0 else torch.empty  # every dW row is written once when a row is kept
        d_weight = new(weight.shape, dtype=weight.dtype, device=weight.device) if needs_w else None  # [V, H]
        d_bias = torch.zeros(V, dtype=acc_dtype, device=weight.device) if needs_b else None  # [V]
        w_acc = None  # [vocab, H] float32: a low-precision dW tile summed over several row tiles
        if needs_w and M > rows and weight.dtype != acc_dtype:
            w_acc = torch.empty(vocab, H, dtype=acc_dtype, device=weight.device)
        buffer = weight.new_empty(rows * vocab, dtype=head_precision.logits_dtype(opts.head_precision, weight.dtype))
        scaled: dict[int, Tensor] = {}  # row tile -> hidden rows × row factor σ (torch/lean.row_scale)
        for v in _tiles(V, vocab):
            w_v, b_v = weight[v], None if bias is None else bias[v]
            for i, r in enumerate(_tiles(M, rows)):
                backends.count_launch(opts.backend)
                g = _tile_logits(
                    hidden[r], w_v, b_v, buffer=buffer, precision=opts.head_precision
                )  # [c, w], overwritten by
                tile_mask = None if row_mask is None else row_mask[r]
                sigma = tiles.tile_grad_(g, v.start, targets[r], tile_mask, grads.at(r), opts)  # dL/dlogits (up to σ)
                if g.dtype != weight.dtype:  # a head_precision's logits: the gradient GEMMs run in the weight's dtype
                    if sigma is not None:
                        g.mul_(sigma[:, None].to(g.dtype))
                    g, sigma = g.to(weight.dtype), None
                h_r = hidden[r]
                if sigma is not None:  # σ depends on the row alone: one scaled copy per row tile ([M, H] in all)
                    if r.start not in scaled:
                        scaled[r.start] = h_r * sigma[:, None]
                    h_r = scaled[r.start]
                if d_hidden is not None and sigma is None:
                    accumulate(d_hidden[r], g, w_v, mode)
                elif d_hidden is not None:
                    d_hidden[r].addcmul_(torch.mm(g, w_v), sigma[:, None])
                if w_acc is not None:
                    tile = w_acc[: v.stop - v.start]
                    if i == 0:
                        tile.zero_()
                    accumulate(tile, g.T, h_r, mode)
                elif d_weight is not None and i == 0:
                    torch.mm(g.T, h_r, out=d_weight[v])
                elif d_weight is not None:
                    d_weight[v].addmm_(g.T, h_r)
                if d_bias is not None:
                    d_bias[v] += g.sum(0, dtype=d_bias.dtype) if sigma is None else sigma.to(d_bias.dtype) @ g
            if w_acc is not None and M > 0:
                d_weight[v].copy_(w_acc[: v.stop - v.start])
        del buffer, w_acc
        if d_hidden is not None and d_hidden.dtype != hidden.dtype:
            d_hidden = cast_in_place(d_hidden, hidden.dtype)
        if d_bias is not None:
            d_bias = d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None


def lean_linear_logprobs(
    hidden, weight, bias, targets, *, opts: PassOptions, row_mask: Tensor | None = None
) -> dict[str, Tensor]:
    """As `fused_linear.fused_linear_logprobs`, in 2-D tiles at the memory floor ("lean" memory)."""
    return named_outputs(opts, *_LeanLinearLogprobsFunction.apply(hidden, weight, bias, targets, row_mask, opts))

"""The vocabulary pass fused with the lm_head: hidden [M, H] and weight [V, H] in; the [M, V] logits only ever
exist one chunk of rows at a time, so memory beyond the gradients is one chunk.

Per chunk: one GEMM for the logits, the backend's vocabulary pass on them (in place), and in the backward the two
gradient GEMMs (dH chunk, dW accumulated in float32 and cast once). On CUDA every GEMM reads its operands in the
input dtype (tensor cores) with float32 accumulation (`gemm_mode`). Two Functions:
- `_FusedLinearLogprobsFunction`: logp (and entropy) out, any loss on top; the backward recomputes each chunk's
  logits (4 GEMMs in all).
- `_FusedLinearTokenLossFunction`: for token-level losses the per-token dL/dlogp is known as soon as a chunk's
  log-probs are, so the gradients are formed in the forward from the logits still in memory and the backward only
  scales them: 3 GEMMs, the floor.
`PassOptions.head_precision` sets the logits GEMM's dtype (`head_precision.py`); the gradient GEMMs stay in
the weight's. With sampling replay (`PassOptions.replay`) each chunk's logits are masked to the sampler's support
in their own buffer before the pass and the in-forward gradient (`replay.py`; a compute-dtype copy where
`replay.masks_in_place` says no); the backward of the 4-GEMM Function masks them again from each row's saved
threshold.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels import head_precision, replay
from grpo_kernels.kernels.function import backend_kernels, checked_rows, nonfinite_rows, not_finite_to_nan, poisoned
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import compute_dtype

# CPU: each chunk's GEMMs stream all of W (and dW) once, so a chunk needs a few hundred rows to keep them
# compute-bound. Measured on 2 cores, B·T = 2048, H = 896, fused-linear forward + backward: V = 151,936 took
# 23.2 / 17.3 / 12.4 / 10.4 / 11.8 s with 16 / 32 / 64 / 128 / 256 MiB chunks (55 to 438 rows); V = 32,000
# 2.5 / 2.5 / 1.8 / 2.1 / 1.9 s (128 to 2,048 rows).


def gemm_mode(device: torch.device) -> str:
    """How the chunk GEMMs treat bf16/fp16 operands on `device` (float32 and float64 ones are used as they are).

    Logits and dH are always GEMMs in the input dtype (float32 accumulation inside the GEMM, output rounded to the
    input dtype, as the logits are). dW, summed over chunks into a float32 accumulator:
    - "out_dtype" (CUDA, torch >= 2.8): `addmm(acc, a, b, out_dtype=float32, out=acc)`, tensor cores, each
      chunk's product added in float32 without being rounded first.
    - "rounded" (CUDA, older torch): each chunk's product in the input dtype (tensor cores), rounded to it, then
      added to the float32 accumulator; no float32 copy of the operands.
    - "upcast" (CPU and other devices): float32 copies of the operands and a float32 GEMM, the numbers the CPU
      path always had. CPU has no out_dtype kernel, and "rounded" would round every chunk's product to bf16 (TRL
      measured the entropy drifting under that). It costs time where the CPU has bf16 GEMMs: on the 2-core
      AVX512-BF16 machine the dW product of a 512-row chunk (V = 32,000, H = 896) took 0.155 s upcast, 0.085 s
      as a bf16 GEMM.
    """
    if device.type != "cuda":
        return "upcast"
    return "out_dtype" if _has_out_dtype() else "rounded"


@functools.cache
def _has_out_dtype() -> bool:
    return "dtype_out" in torch.ops.aten.addmm.overloads() and not _OUT_DTYPE_REFUSED


_OUT_DTYPE_REFUSED: list[str] = []  # the error of a torch whose CUDA addmm refuses a float32 `self` (then "rounded")


ROUNDED_BLOCK = 8192  # dW rows per rounded product ("rounded"): its temporary is at most 8192 × H


def accumulate(acc: Tensor, a: Tensor, b: Tensor, mode: str) -> None:
    """acc [P, Q] (float32, or float64 for float64 input) += a [P, K] @ b [K, Q], as `gemm_mode` says."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif mode == "out_dtype" and not _OUT_DTYPE_REFUSED:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except RuntimeError as error:  # an early out_dtype kernel's dtype check, raised before any work
            if "same dtype" not in str(error):
                raise
            _OUT_DTYPE_REFUSED.append(str(error))
            _has_out_dtype.cache_clear()
            warnings.warn(f"{error}: dW products are rounded to the input dtype per chunk instead", stacklevel=2)
            accumulate(acc, a, b, "rounded")
    elif mode in ("out_dtype", "rounded"):
        for start in range(0, a.shape[0], ROUNDED_BLOCK):
            stop = start + ROUNDED_BLOCK
            acc[start:stop].add_(torch.mm(a[start:stop], b))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def rows_per_chunk(opts: PassOptions, num_rows: int) -> int:
    """The chunk's rows the engine chose (`PassOptions.chunk_size`, from `engine/memory.chunk_rows`), at least 1 and
    at most `num_rows`."""
    if opts.chunk_size is None:
        raise ValueError("the fused lm_head needs PassOptions.chunk_size: its rows per chunk (engine/memory.py)")
    return max(1, min(opts.chunk_size, num_rows))


def _chunks(num_rows: int, rows: int):
    for start in range(0, num_rows, rows):
        yield slice(start, min(start + rows, num_rows))


def _cat(parts: list[Tensor], like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The chunks' per-row values as one [M] tensor; no chunks (M = 0, every token masked): an empty one."""
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=like.device)


def _joined(parts: list[Tensor | None], dim: int) -> Tensor | None:
    """The chunks' replay state (θ [c, 1], full lse [1, c]) joined along `dim`; None when the chunks have none."""
    parts = [x for x in parts if x is not None]
    return torch.cat(parts, dim) if parts else None


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, buffer: Tensor, precision: str) -> Tensor:
    """The chunk's logits [1, c, V] for its hidden rows [c, H], written into `buffer` [≥c, V] (weight and bias in
    its dtype, `head_precision.operands`): one buffer serves every chunk (a fresh allocation per chunk pays its page
    faults again on CPU each time)."""
    return head_precision.logits_gemm(hidden, weight, bias, buffer[: hidden.shape[0]], precision)[None]


class _GradientSink:
    """Accumulates the gradients of hidden, weight and bias from each chunk's dL/dlogits (dW and db in float32, or
    float64 for float64 input; GEMMs as `gemm_mode` says for the device)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, bool, bool]):
        acc = compute_dtype(weight.dtype)
        self.mode = gemm_mode(weight.device)
        self.hidden = torch.empty_like(hidden) if needs[0] else None  # [M, H]
        self.weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None  # [V, H]
        self.bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs[2] else None  # [V]

    def add(self, rows: slice, grad_logits: Tensor, hidden: Tensor, weight: Tensor) -> None:
        """grad_logits [c, V] of the rows' logits (cast to the weight's dtype: the gradient GEMMs run in it);
        hidden [c, H] the rows' inputs."""
        grad_logits = head_precision.cast(grad_logits, weight.dtype)
        if self.hidden is not None:
            torch.mm(grad_logits, weight, out=self.hidden[rows])
        if self.weight is not None:
            accumulate(self.weight, grad_logits.T, hidden, self.mode)
        if self.bias is not None:
            self.bias += grad_logits.sum(0, dtype=self.bias.dtype)  # [V], no float32 copy of the chunk

    def result(self, weight: Tensor, bias: Tensor | None, scale: Tensor | None = None):
        """(grad_hidden, grad_weight, grad_bias), handed over: the sink keeps no reference, so autograd can
        take the buffers as the parameters' .grad instead of copying them."""
        grads = [self.hidden, self.weight, self.bias]
        if not torch.compiler.is_compiling():  # compiled, the graph owns the buffers (and cannot trace the release)
            self.hidden = self.weight = self.bias = None
        if scale is not None:  # in place: a second [V, H] buffer would double the memory floor
            grads = [None if g is None else g.mul_(scale.to(g.dtype)) for g in grads]
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grads[0], cast(grads[1], weight), None if bias is None else cast(grads[2], bias)


def _row_masks(rows: int, row_mask: Tensor | None, device) -> Callable[[slice], Tensor]:
    """The vocabulary pass's mask [1, c] for a chunk's rows: all kept (the rows were gathered), or `row_mask`'s."""
    if row_mask is not None:
        return lambda r: row_mask[None, r]
    ones = torch.ones((1, rows), dtype=torch.bool, device=device)
    return lambda r: ones[:, : r.stop - r.start]


class _FusedLinearLogprobsFunction(torch.autograd.Function):
    """(hidden [M, H], weight [V, H], bias [V] | None, targets [M], row_mask [M] bool | None) -> logp [M],
    entropy [M] or empty, and each asked statistic [M] (not differentiable). row_mask None: every row is kept;
    else the rows it drops give 0 and no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, opts: PassOptions):
        kernels = backend_kernels(opts.backend)
        M, V = targets.shape[0], weight.shape[0]
        w, b = head_precision.operands(weight, bias, opts.head_precision)
        rows = rows_per_chunk(opts, M)
        masks = _row_masks(rows, row_mask, hidden.device)
        buffer = w.new_empty(rows, V)  # [rows, V]
        scratch = replay.chunk_scratch(opts, rows, weight)  # replay: its windows' buffers, in the compute dtype
        logps, lses, entropies, thetas, full_lses = [], [], [], [], []
        stats = {name: [] for name in opts.stats}
        for r in _chunks(M, rows):
            backends.count_launch(opts.backend)
            z = _logits(hidden[r], w, b, buffer, opts.head_precision)  # [1, c, V]
            if scratch is None:
                logp, lse, entropy, chunk_stats = kernels.token_logprobs_fwd(
                    z,
                    targets[None, r],
                    masks(r),
                    opts.temperature,
                    opts.with_entropy,
                    **opts.transform(),
                    stats=opts.stats,
                )
            else:
                logp, lse, entropy, chunk_stats, state = replay.chunk_forward(
                    kernels, z, targets[None, r], masks(r), opts, r, scratch
                )
                thetas.append(state.window.theta)
                full_lses.append(state.full_lse)
            logps.append(logp[0])
            lses.append(lse[0])
            if opts.with_entropy:
                entropies.append(entropy[0])
            for name, acc in stats.items():
                acc.append(chunk_stats[name][0])
        logp, lse = _cat(logps, hidden), _cat(lses, hidden)  # [M] each
        logp = checked_rows(opts.row_check, lse, logp, row_mask)
        entropy = _cat(entropies, hidden) if opts.with_entropy else logp.new_empty(0)  # [M]
        bools = ("is_top1", "outside_support")
        stats = [_cat(acc, hidden, torch.bool if name in bools else torch.float32) for name, acc in stats.items()]
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))  # one call: each replaces
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets, row_mask, lse, entropy)
        ctx.opts, ctx.rows = opts, rows
        ctx.replayed = (_joined(thetas, 0), _joined(full_lses, 1))  # [M, 1] θ (rule), [1, M] full lse, or None
        return logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_stats):
        hidden, weight, bias, targets, row_mask, lse, entropy = ctx.saved_tensors
        opts, rows = ctx.opts, ctx.rows
        kernels = backend_kernels(opts.backend)
        if not opts.with_entropy:
            grad_entropy = None
        sink = _GradientSink(hidden, weight, bias, ctx.needs_input_grad[:3])
        masks = _row_masks(rows, row_mask, hidden.device)
        w, b = head_precision.operands(weight, bias, opts.head_precision)
        buffer = w.new_empty(rows, weight.shape[0])  # [rows, V]
        scratch = replay.chunk_scratch(opts, rows, weight)
        thetas, full_lses = ctx.replayed
        for r in _chunks(targets.shape[0], rows):
            backends.count_launch(opts.backend)
            z = _logits(hidden[r], w, b, buffer, opts.head_precision)  # [1, c, V], overwritten by its gradient
            grad_args = (
                lse[None, r],
                entropy[None, r] if grad_entropy is not None else None,
                None if grad_logp is None else grad_logp[None, r],
                None if grad_entropy is None else grad_entropy[None, r],
            )
            if scratch is None:
                kernels.token_logprobs_bwd(z, targets[None, r], masks(r), *grad_args[:4], opts.temperature, z,
                                           **opts.transform())  # fmt: skip
                sink.add(r, z[0], hidden[r], weight)
                continue
            theta, full_lse = None if thetas is None else thetas[r], None if full_lses is None else full_lses[:, r]
            state = replay.chunk_state(z, targets[None, r], opts, r, scratch, theta, full_lse)
            grads = replay.RowGrads(targets[r], masks(r)[0], *(None if x is None else x[0] for x in grad_args))
            grad = replay.chunk_grad(kernels, state, z, grads, opts, scratch)
            sink.add(r, grad, hidden[r], weight)
        return (*sink.result(weight, bias), None, None, None)


ChunkLoss = Callable[[slice, Tensor, Tensor | None], tuple[Tensor, Tensor | None, Tensor | None]]


class _FusedLinearTokenLossFunction(torch.autograd.Function):
    """(hidden, weight, bias, targets, row_mask) -> (loss, logp [M], entropy [M] or empty) for a token-level loss
    given as `chunk_loss(rows, logp_rows, entropy_rows or None)` -> (its share of the loss, dL/dlogp, dL/dentropy
    or None), [c] each; it must give the rows `row_mask` drops no loss and no gradient. row_mask as in
    `_FusedLinearLogprobsFunction`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, opts: PassOptions, chunk_loss: ChunkLoss):
        kernels = backend_kernels(opts.backend)
        M, V = targets.shape[0], weight.shape[0]
        w, b = head_precision.operands(weight, bias, opts.head_precision)
        rows = rows_per_chunk(opts, M)
        masks = _row_masks(rows, row_mask, hidden.device)
        sink = _GradientSink(hidden, weight, bias, ctx.needs_input_grad[:3])
        loss = torch.zeros((), dtype=compute_dtype(w.dtype), device=hidden.device)  # float64 stays float64
        # a kept row with a non-finite dL/dlogits makes the loss NaN; when the inputs were checked (and the rows are
        # below) only the gradients can still overflow, and their sum is finite iff they are
        checked = opts.row_check is not None
        bad = torch.zeros((), dtype=torch.bool, device=hidden.device)  # unchecked: a flagged row
        gradient_sum = torch.zeros_like(loss)  # checked: Σ dL/dlogp + Σ dL/dentropy
        logps, lses, entropies = [], [], []
        stats = {name: [] for name in opts.stats}  # replay's statistics
        buffer = w.new_empty(rows, V)  # [rows, V]
        scratch = replay.chunk_scratch(opts, rows, weight)  # replay: its windows' buffers, in the compute dtype
        backends.count_launch("fused_linear_token_loss")
        for r in _chunks(M, rows):
            backends.count_launch(opts.backend, 2)
            z = _logits(hidden[r], w, b, buffer, opts.head_precision)  # [1, c, V]
            mask = masks(r)  # [1, c]
            if scratch is None:
                logp, lse, entropy, chunk_stats = kernels.token_logprobs_fwd(
                    z, targets[None, r], mask, opts.temperature, opts.with_entropy, **opts.transform(), stats=opts.stats
                )
            else:
                logp, lse, entropy, chunk_stats, state = replay.chunk_forward(
                    kernels, z, targets[None, r], mask, opts, r, scratch
                )
            share, grad_logp, grad_entropy = chunk_loss(r, logp[0], entropy[0] if opts.with_entropy else None)
            loss += share
            grad_logp = None if grad_logp is None else grad_logp[None]  # [1, c]
            grad_entropy = None if grad_entropy is None else grad_entropy[None]  # [1, c]
            grad_args = (lse, entropy if grad_entropy is not None else None, grad_logp, grad_entropy)
            if scratch is None:
                kernels.token_logprobs_bwd(
                    z, targets[None, r], mask, *grad_args, opts.temperature, z, **opts.transform()
                )
                sink.add(r, z[0], hidden[r], weight)
            else:
                grads = replay.RowGrads(targets[r], mask[0], *(None if x is None else x[0] for x in grad_args))
                sink.add(r, replay.chunk_grad(kernels, state, z, grads, opts, scratch), hidden[r], weight)
            if checked:
                for grad in (g for g in (grad_logp, grad_entropy) if g is not None):
                    gradient_sum += grad.sum()
            else:
                bad |= (nonfinite_rows(lse, logp, grad_logp, grad_entropy) & mask).any()
            logps.append(logp[0])
            lses.append(lse[0])
            entropies.append(entropy[0] if opts.with_entropy else logp.new_empty(0))
            for name, acc in stats.items():
                acc.append(chunk_stats[name][0])
        ctx.sink, ctx.weight_like = sink, (weight, bias)
        logp, entropy = _cat(logps, hidden), _cat(entropies, hidden)
        logp = checked_rows(opts.row_check, _cat(lses, hidden), logp, row_mask)
        bools = ("is_top1", "outside_support")
        stats = [_cat(acc, hidden, torch.bool if name in bools else torch.float32) for name, acc in stats.items()]
        ctx.mark_non_differentiable(logp, entropy, *stats)
        return not_finite_to_nan(loss, gradient_sum) if checked else poisoned(loss, bad), logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy, *_grad_stats):
        (weight, bias), sink = ctx.weight_like, ctx.sink
        ctx.sink = None
        return (*sink.result(weight, bias, scale=grad_loss), None, None, None, None)


def fused_linear_logprobs(
    hidden, weight, bias, targets, *, opts: PassOptions, row_mask: Tensor | None = None
) -> dict[str, Tensor]:
    """{"logp", "entropy" (if asked), each of `opts.stats`}, all [M], of the rows (0 where `row_mask` drops one), in
    row chunks ("fast" memory); differentiable in hidden, weight, bias (the statistics are not)."""
    return named_outputs(opts, *_FusedLinearLogprobsFunction.apply(hidden, weight, bias, targets, row_mask, opts))


def named_outputs(opts: PassOptions, logp: Tensor, entropy: Tensor, *stats: Tensor) -> dict[str, Tensor]:
    """A log-prob Function's outputs by name: "logp", "entropy" (if asked), each of `opts.stats`."""
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    return out | dict(zip(opts.stats, stats, strict=True))


def fused_linear_token_loss(
    hidden, weight, bias, targets, *, opts: PassOptions, chunk_loss: ChunkLoss, row_mask: Tensor | None = None
):
    """(loss, detached logp [M], detached entropy [M] | None, {each of `opts.stats`: [M]}) of a token-level loss,
    gradients formed in forward."""
    loss, logp, entropy, *stats = _FusedLinearTokenLossFunction.apply(
        hidden, weight, bias, targets, row_mask, opts, chunk_loss
    )
    return loss, logp, (entropy if opts.with_entropy else None), dict(zip(opts.stats, stats, strict=True))

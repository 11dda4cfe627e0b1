"""The fused lm_head on a vocabulary shard of the weight (`kernels/parallel.py` holds the merge and the byte count).

Per chunk of rows: the shard's logits [c, V_r] (one GEMM), the backend's vocabulary pass on them; once every chunk's
O(c) statistics are in, two all-reduces merge them over the group (`merge_stats`). The backward recomputes each
chunk's shard logits, runs the backend's vocabulary backward with the global lse and entropy, and forms dW of the
shard and this rank's partial dH, which one all-reduce sums (`reduce_hidden_grad`; verl's `linear_cross_entropy`
leaves it to the caller). 4 GEMMs per chunk in all; memory beyond the gradients is one [c, V_r] chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels import head_precision
from grpo_kernels.kernels import replay as replay_steps
from grpo_kernels.kernels.function import backend_kernels, checked_rows
from grpo_kernels.kernels.fused_linear import accumulate, gemm_mode, rows_per_chunk
from grpo_kernels.kernels.parallel import (
    VocabShard,
    merge_replay,
    merge_stats,
    reduce_hidden_grad,
    remove_foreign_onehot,
)
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import compute_dtype


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, buffer: Tensor, precision: str) -> Tensor:
    """The chunk's shard logits [1, c, V_r] of hidden rows [c, H], in `buffer` (one buffer serves every chunk; weight
    and bias in its dtype, `head_precision.operands`)."""
    return head_precision.logits_gemm(hidden, weight, bias, buffer[: hidden.shape[0]], precision)[None]


def _row_chunks(hidden: Tensor, weight: Tensor, opts: PassOptions):
    rows = rows_per_chunk(opts, hidden.shape[0])
    return rows, [slice(s, min(s + rows, hidden.shape[0])) for s in range(0, hidden.shape[0], rows)]


class _ParallelFusedLinearFunction(torch.autograd.Function):
    """(hidden [M, H], shard weight [V_r, H], shard bias [V_r] | None, targets [M] whole-vocabulary ids,
    row_mask [M] | None) -> logp [M], entropy [M] or empty, over the whole vocabulary."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, opts: PassOptions, shard, reduce_hidden_grad):
        kernels = backend_kernels(opts.backend)
        M = targets.shape[0]
        mask = torch.ones(M, dtype=torch.bool, device=hidden.device) if row_mask is None else row_mask  # [M]
        local, owned = shard.local_targets(targets)  # [M] each
        rows, chunks = _row_chunks(hidden, weight, opts)
        w, b = head_precision.operands(weight, bias, opts.head_precision)
        buffer = w.new_empty(rows, weight.shape[0])  # [rows, V_r]
        found = {name: hidden.new_zeros(M, dtype=torch.float32) for name in ("logp", "lse", "lse_full")}  # [M] each
        if opts.with_entropy:
            found["entropy"] = hidden.new_zeros(M, dtype=torch.float32)
        found["outside"] = torch.zeros(M, dtype=torch.bool, device=hidden.device)
        replayed = _Replayed(opts, shard, rows, weight)
        for r in chunks:
            backends.count_launch(opts.backend)
            z = _chunk_logits(hidden[r], w, b, buffer, opts.head_precision)  # [1, c, V_r]
            if replayed.scratch is None:
                logp, lse, entropy, _ = kernels.token_logprobs_fwd(
                    z, local[None, r], mask[None, r], opts.temperature, opts.with_entropy, **opts.transform()
                )
                logp, lse, entropy = logp[0], lse[0], None if entropy is None else entropy[0]
            else:
                window = replayed.window(z[0], r, local, owned, None)
                logp, lse, entropy, _ = replay_steps.window_forward(
                    kernels, window, local[r], mask[r], opts.with_entropy, ()
                )
                found["lse_full"][r], found["outside"][r] = window.lse_full, window.outside
                replayed.keep(window)
            found["logp"][r], found["lse"][r] = logp, lse
            if opts.with_entropy:
                found["entropy"][r] = entropy
        stats = {}
        if replayed.scratch is None:
            lse, logp, entropy = merge_stats(
                found["lse"], found["logp"], found.get("entropy"), owned, mask, shard.group
            )
        else:
            lse, logp, entropy, stats = merge_replay(found, owned, mask, opts, shard.group, replayed.reduce)
        logp = checked_rows(opts.row_check, lse, logp, row_mask)
        entropy = logp.new_empty(0) if entropy is None else entropy
        stats = [stats[name] for name in opts.stats]
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, local, owned, mask, lse, entropy)
        ctx.replayed = replayed.saved()
        ctx.opts, ctx.shard, ctx.reduce_hidden_grad = opts, shard, reduce_hidden_grad
        return logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_stats):
        hidden, weight, bias, local, owned, mask, lse, entropy = ctx.saved_tensors
        opts: PassOptions = ctx.opts
        kernels = backend_kernels(opts.backend)
        if not opts.with_entropy:
            grad_entropy = None
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        acc = compute_dtype(weight.dtype)
        mode = gemm_mode(weight.device)
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None  # [M, H]
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs_bias else None
        rows, chunks = _row_chunks(hidden, weight, opts)
        w, b = head_precision.operands(weight, bias, opts.head_precision)
        buffer = w.new_empty(rows, weight.shape[0])  # [rows, V_r]
        pick = lambda x, r: None if x is None else x[None, r]  # noqa: E731  [1, c]
        replayed = _Replayed(opts, ctx.shard, rows, weight, ctx.replayed)
        for r in chunks:
            backends.count_launch(opts.backend)
            z = _chunk_logits(hidden[r], w, b, buffer, opts.head_precision)  # [1, c, V_r], overwritten by its gradient
            if replayed.scratch is not None:
                window = replayed.window(z[0], r, local, owned, replayed.theta(r), forward=False)
                foreign = None if grad_logp is None else torch.where((owned | ~mask)[r], 0.0, grad_logp[r])
                entropy_read = entropy if grad_entropy is not None else None
                grads = replay_steps.RowGrads(local, mask, lse, entropy_read, grad_logp, grad_entropy).at(r)
                grad = replay_steps.window_grad_(kernels, window, z[0], grads, opts, replayed.scratch, foreign)
                z[0].copy_(grad)
            else:
                x0 = z[..., 0].clone()  # [1, c]
                kernels.token_logprobs_bwd(
                    z,
                    local[None, r],
                    mask[None, r],
                    lse[None, r],
                    pick(entropy if grad_entropy is not None else None, r),
                    pick(grad_logp, r),
                    pick(grad_entropy, r),
                    opts.temperature,
                    z,
                    **opts.transform(),
                )
                remove_foreign_onehot(z, x0, pick(owned | ~mask, r), pick(grad_logp, r), opts)
            g = head_precision.cast(z[0], weight.dtype)  # [c, V_r]: the gradient GEMMs run in the weight's dtype
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[r])
            if grad_weight is not None:
                accumulate(grad_weight, g.T, hidden[r], mode)
            if grad_bias is not None:
                grad_bias += g.sum(0, dtype=grad_bias.dtype)
        if grad_hidden is not None and ctx.reduce_hidden_grad:
            dist.all_reduce(grad_hidden, group=ctx.shard.group)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_hidden, cast(grad_weight, weight), cast(grad_bias, bias), None, None, None, None, None


class _Replayed:
    """Sampling replay on the shard's chunks (`opts.replay`; `scratch` None without it): each chunk's logits masked
    in a compute-dtype scratch to the support merged over the group (`replay.RowReduce`), each row's θ kept for
    the backward."""

    def __init__(self, opts: PassOptions, shard: VocabShard, rows: int, weight: Tensor, thetas: Tensor | None = None):
        self.opts, self.shard = opts, shard
        self.scratch = (
            None if opts.replay is None else replay_steps.Scratch(rows, weight.shape[0], weight.dtype, weight.device)
        )
        self.reduce = replay_steps.RowReduce(shard.vocab, shard.group)
        self.thetas, self._kept = thetas, []

    def window(self, z: Tensor, r: slice, local: Tensor, owned: Tensor, theta: Tensor | None, forward: bool = True):
        """The chunk's rows z [c, V_r] masked (θ [c, 1] from the forward, or None: computed)."""
        ids = replay_steps.row_ids(self.opts.replay, r)
        ids = None if ids is None else ids - self.shard.start  # the shard's columns; ids elsewhere dropped
        return replay_steps.masked_window(
            z,
            local[r],
            ids=ids,
            theta=theta,
            opts=self.opts,
            scratch=self.scratch,
            rows=self.reduce,
            owned=owned[r],
            forward=forward,
        )

    def keep(self, window) -> None:
        if window.theta is not None:
            self._kept.append(window.theta)

    def saved(self) -> Tensor | None:
        """Every row's θ [M, 1] (None for kept ids or without replay)."""
        return torch.cat(self._kept) if self._kept else None

    def theta(self, r: slice) -> Tensor | None:
        return None if self.thetas is None else self.thetas[r]


def fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    opts: PassOptions,
    row_mask: Tensor | None,
    shard: VocabShard,
) -> dict[str, Tensor]:
    """`fused_linear.fused_linear_logprobs` on this rank's shard of the lm_head: {"logp", "entropy" (if asked)}, [M]
    each, over the whole vocabulary; dW and db of the shard; dH summed over the group (inside
    `parallel.partial_hidden_grad`: this rank's share of it)."""
    logp, entropy, *stats = _ParallelFusedLinearFunction.apply(
        hidden, weight, bias, targets, row_mask, opts, shard, reduce_hidden_grad()
    )
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    return out | dict(zip(opts.stats, stats, strict=True))

"""Sampling replay on the logits API: the autograd Function that runs `kernels.replay`'s masked windows through the
backend's plain pass, a window of rows at a time (one [window, V] scratch, never [N, V]), and its forward alone
when no gradient is taken."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels import parallel
from grpo_kernels.kernels.function import (
    backend_kernels,
    check_not_overwritten,
    checked_rows,
    consume,
    in_place_or_new,
    logits_pass,
    mark_overwritten,
)
from grpo_kernels.kernels.parallel import VocabShard, merge_replay
from grpo_kernels.kernels.pass_options import PassOptions, Replay
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.replay import (
    RowGrads,
    RowReduce,
    Scratch,
    masked_window,
    row_ids,
    window_forward,
    window_grad_,
    window_rows,
)


def _windows(logits: Tensor, step: int):
    """(rows, x) per window of at most `step` consecutive rows of logits [B, T, V]: `rows` the slice of the
    flattened [B·T] rows, x [C, V] a view (windows never cross a sequence unless the logits flatten)."""
    B, T, V = logits.shape
    try:
        flat = logits.view(-1, V)
    except RuntimeError:
        flat = None
    if flat is not None:
        for start in range(0, B * T, step):
            yield slice(start, min(start + step, B * T)), flat[start : start + step]
        return
    for b in range(B):
        for start in range(0, T, step):
            stop = min(start + step, T)
            yield slice(b * T + start, b * T + stop), logits[b, start:stop]


def _at(x: Tensor, rows: slice) -> Tensor:
    """The window of x [B, T, V] at the flattened `rows` (inside one sequence unless x flattens), [C, V]."""
    B, T, V = x.shape
    try:
        return x.view(-1, V)[rows]
    except RuntimeError:
        b, start = divmod(rows.start, T)
        return x[b, start : start + rows.stop - rows.start]


def _full_pass_options(opts: PassOptions) -> PassOptions:
    """The ordinary pass beside a replayed one (the full distribution's entropy): no replay, no statistics, never
    in place (two backward passes read the logits)."""
    return PassOptions(
        backend=opts.backend,
        temperature=opts.temperature,
        with_entropy=True,
        logit_scale=opts.logit_scale,
        final_logit_softcapping=opts.final_logit_softcapping,
        inplace=False,
    )


class _ReplayLogprobsFunction(torch.autograd.Function):
    """logits [B, T, V] (a vocabulary shard's [B, T, V_r] with `shard`) -> (logp [B, T], entropy [B, T] or empty,
    *the asked statistics) over the replayed support, a window of rows at a time; saves O(B·T) statistics and each
    row's θ, never [B, T, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions, shard: VocabShard | None):
        check_not_overwritten(logits)
        logp, lse, entropy, stats, theta = _replay_forward(logits, targets, mask, opts, shard)
        entropy = logp.new_empty(0) if entropy is None else entropy
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, mask, lse, entropy, theta)
        ctx.opts, ctx.shard = opts, shard
        ctx.consumed = False
        return logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_stats):
        opts: PassOptions = ctx.opts
        consume(ctx)
        logits, targets, mask, lse, entropy, theta = ctx.saved_tensors
        if not opts.with_entropy:
            grad_entropy = None
        version = logits._version
        out = in_place_or_new(ctx, logits)
        kernels = backend_kernels(opts.backend)
        rows_of = _Rows(logits, targets, mask, ctx.shard)
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        lse, g, g_h = flat(lse), flat(grad_logp), flat(grad_entropy)
        entropy = flat(entropy) if grad_entropy is not None else None
        scratch = rows_of.scratch()
        grads = RowGrads(rows_of.targets, rows_of.mask, lse, entropy, g, g_h)
        backends.count_launch(opts.backend)
        for rows, x in _windows(logits, scratch.shape[0]):
            theta_rows = None if theta.numel() == 0 else theta[rows, None]
            window = rows_of.window(x, rows, opts, scratch, theta_rows, forward=False)
            foreign = None
            if ctx.shard is not None and g is not None:  # the one-hot of rows whose target another shard owns
                foreign = torch.where(rows_of.owned[rows] | ~rows_of.mask[rows], 0.0, g[rows])
            grad = window_grad_(kernels, window, x, grads.at(rows), opts, scratch, foreign)
            _at(out, rows).copy_(grad)
        mark_overwritten(ctx, logits, version)
        return out, None, None, None, None


class _Rows:
    """A replayed pass's flattened rows: targets (a shard's columns, with the rows whose target it owns), mask."""

    def __init__(self, logits: Tensor, targets: Tensor, mask: Tensor, shard: VocabShard | None):
        self.logits, self.shard, self.mask = logits, shard, mask.reshape(-1)
        self.targets, self.owned = targets.reshape(-1), None
        if shard is not None:
            self.targets, self.owned = shard.local_targets(self.targets)
        self.reduce = RowReduce(
            logits.shape[-1] if shard is None else shard.vocab, None if shard is None else shard.group
        )

    def scratch(self) -> Scratch:
        """Windows sized by the whole vocabulary: every rank of a shard's group runs the same windows."""
        n, V = self.mask.shape[0], self.logits.shape[-1]
        return Scratch(window_rows(self.reduce.vocab, n), V, self.logits.dtype, self.logits.device)

    def window(self, x: Tensor, rows: slice, opts: PassOptions, scratch: Scratch, theta: Tensor | None,
               forward: bool = True):  # fmt: skip
        ids = row_ids(opts.replay, rows)
        if ids is not None and self.shard is not None:  # the shard's columns; ids elsewhere dropped
            ids = ids - self.shard.start
        owned = None if self.owned is None else self.owned[rows]
        targets = self.targets[rows]
        return masked_window(
            x, targets, ids=ids, theta=theta, opts=opts, scratch=scratch, rows=self.reduce, owned=owned, forward=forward
        )


def _replay_forward(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions, shard: VocabShard | None):
    """The replayed pass, window by window: logp, lse (support), entropy or None, [statistics], θ (or empty); on a
    shard merged over its group (`parallel.merge_replay`)."""
    replay: Replay = opts.replay
    kernels = backend_kernels(opts.backend)
    B, T, V = logits.shape
    dtype = compute_dtype(logits.dtype)
    rows_of = _Rows(logits, targets, mask, shard)
    scratch = rows_of.scratch()
    names = ("logp", "lse", "lse_full", *(("entropy",) if opts.with_entropy else ()))
    out = {name: torch.zeros(B * T, dtype=dtype, device=logits.device) for name in names}  # [B·T] each
    out["outside"] = torch.zeros(B * T, dtype=torch.bool, device=logits.device)
    # one process: the statistics come from each window; a shard's are merged once every window's are in
    local_stats = opts.stats if shard is None else ()
    stats = {name: torch.zeros(B * T, dtype=torch.bool if name == "outside_support" else dtype,
                               device=logits.device) for name in local_stats}  # fmt: skip
    theta = torch.empty(B * T if replay.kept_ids is None else 0, dtype=dtype, device=logits.device)
    backends.count_launch(opts.backend)
    for rows, x in _windows(logits, scratch.shape[0]):
        window = rows_of.window(x, rows, opts, scratch, None)
        found = window_forward(
            kernels,
            window,
            rows_of.targets[rows],
            rows_of.mask[rows],
            opts.with_entropy,
            local_stats,
            replay.truncates(rows_of.reduce.vocab),
        )
        out["logp"][rows], out["lse"][rows] = found[0], found[1]
        out["lse_full"][rows], out["outside"][rows] = window.lse_full, window.outside
        if opts.with_entropy:
            out["entropy"][rows] = found[2]
        for name, x in found[3].items():
            stats[name][rows] = x
        if window.theta is not None:
            theta[rows] = window.theta[:, 0]
    lse, logp, entropy = out["lse"], out["logp"], out.get("entropy")
    if shard is not None:
        lse, logp, entropy, stats = merge_replay(out, rows_of.owned, rows_of.mask, opts, shard.group, rows_of.reduce)
    logp = checked_rows(opts.row_check, lse.view(B, T), logp.view(B, T), None if shard is None else mask)
    entropy = None if entropy is None else entropy.view(B, T)
    return logp, lse.view(B, T), entropy, [stats[name].view(B, T) for name in opts.stats], theta


def replayed_logits_pass(
    logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions, shard: VocabShard | None = None
) -> dict[str, Tensor]:
    """`function.logits_pass` (`parallel.shard_logits_pass` on a vocabulary shard) over the replayed support
    (`opts.replay`): {"logp", "entropy" (if asked; the support's, or the whole distribution's with
    `Replay.full_entropy`), each of `opts.stats`}, all [B, T]."""
    replay: Replay = opts.replay
    full = replay.full_entropy and opts.with_entropy
    if full:  # the entropy from an ordinary pass beside the replayed one
        plain = _full_pass_options(opts)
        if shard is None:
            from_full = logits_pass(logits, targets, mask, plain)
        else:
            from_full = parallel.shard_logits_pass(logits, targets, mask, plain, shard=shard)
        opts = dataclasses.replace(opts, with_entropy=False, inplace=False)
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, entropy, *stats = _ReplayLogprobsFunction.apply(logits, targets, mask, opts, shard)
    else:
        logp, _, entropy, stats, _ = _replay_forward(logits, targets, mask, opts, shard)
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    if full:
        out["entropy"] = from_full["entropy"]
    return out | dict(zip(opts.stats, stats, strict=True))

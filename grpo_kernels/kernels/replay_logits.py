"""Sampling replay on the logits API: the autograd Function that runs `kernels.replay`'s masked windows through the
backend's plain pass, a window of rows at a time (one [window, V] scratch, never [N, V]), and its forward alone
when no gradient is taken."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.function import (
    backend_kernels,
    check_not_overwritten,
    checked_rows,
    consume,
    in_place_or_new,
    mark_overwritten,
)
from grpo_kernels.kernels.function import vocab_pass as function_vocab_pass
from grpo_kernels.kernels.pass_options import PassOptions, Replay
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.replay import Scratch, masked_window, row_ids, window_forward, window_grad_, window_rows


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
    """logits [B, T, V] -> (logp [B, T], entropy [B, T] or empty, *the asked statistics) over the replayed support,
    a window of rows at a time; saves O(B·T) statistics and each row's θ, never [B, T, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions):
        check_not_overwritten(logits)
        logp, lse, entropy, stats, theta = _replay_forward(logits, targets, mask, opts)
        entropy = logp.new_empty(0) if entropy is None else entropy
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, mask, lse, entropy, theta)
        ctx.opts = opts
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
        B, T, V = logits.shape
        scratch = Scratch(window_rows(V, B * T), V, logits.dtype, logits.device)
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        targets, mask, lse, g, g_h = flat(targets), flat(mask), flat(lse), flat(grad_logp), flat(grad_entropy)
        entropy = flat(entropy) if grad_entropy is not None else None
        backends.count_launch(opts.backend)
        for rows, x in _windows(logits, scratch.shape[0]):
            theta_rows = None if theta.numel() == 0 else theta[rows, None]
            window = masked_window(x, targets[rows], opts.replay, row_ids(opts.replay, rows), theta_rows, opts, scratch)
            grad = window_grad_(
                kernels,
                window,
                x,
                targets[rows],
                mask[rows],
                lse[rows],
                None if entropy is None else entropy[rows],
                None if g is None else g[rows],
                None if g_h is None else g_h[rows],
                opts,
                scratch,
            )
            _at(out, rows).copy_(grad)
        mark_overwritten(ctx, logits, version)
        return out, None, None, None


def _replay_forward(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions):
    """The replayed pass, window by window: logp, lse (support), entropy or None, [statistics], θ (or empty)."""
    replay: Replay = opts.replay
    kernels = backend_kernels(opts.backend)
    B, T, V = logits.shape
    dtype = compute_dtype(logits.dtype)
    scratch = Scratch(window_rows(V, B * T), V, logits.dtype, logits.device)
    flat_targets, flat_mask = targets.reshape(-1), mask.reshape(-1)
    logp, lse = (torch.zeros(B * T, dtype=dtype, device=logits.device) for _ in range(2))
    entropy = torch.zeros_like(logp) if opts.with_entropy else None
    stats = {
        name: torch.zeros(B * T, dtype=torch.bool if name in ("is_top1", "outside_support") else dtype,
                          device=logits.device)
        for name in opts.stats
    }  # fmt: skip
    theta = torch.empty(B * T if replay.kept_ids is None else 0, dtype=dtype, device=logits.device)
    backends.count_launch(opts.backend)
    for rows, x in _windows(logits, scratch.shape[0]):
        window = masked_window(x, flat_targets[rows], replay, row_ids(replay, rows), None, opts, scratch)
        found = window_forward(
            kernels, window, flat_targets[rows], flat_mask[rows], opts.with_entropy, opts.stats, replay.truncates(V)
        )
        logp[rows], lse[rows] = found[0], found[1]
        if entropy is not None:
            entropy[rows] = found[2]
        for name, x in found[3].items():
            stats[name][rows] = x
        if window.theta is not None:
            theta[rows] = window.theta[:, 0]
    logp = checked_rows(opts.row_check, lse.view(B, T), logp.view(B, T), None)
    entropy = None if entropy is None else entropy.view(B, T)
    return logp, lse.view(B, T), entropy, [stats[name].view(B, T) for name in opts.stats], theta


def vocab_pass(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions) -> dict[str, Tensor]:
    """`function.vocab_pass` over the replayed support (`opts.replay`): {"logp", "entropy" (if asked; the support's,
    or the whole distribution's with `Replay.full_entropy`), each of `opts.stats`}, all [B, T]."""
    replay: Replay = opts.replay
    full = replay.full_entropy and opts.with_entropy
    if full:  # the entropy from an ordinary pass beside the replayed one
        from_full = function_vocab_pass(logits, targets, mask, _full_pass_options(opts))
        opts = dataclasses.replace(opts, with_entropy=False, inplace=False)
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, entropy, *stats = _ReplayLogprobsFunction.apply(logits, targets, mask, opts)
    else:
        logp, _, entropy, stats, _ = _replay_forward(logits, targets, mask, opts)
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    if full:
        out["entropy"] = from_full["entropy"]
    return out | dict(zip(opts.stats, stats, strict=True))

"""The autograd Function of the vocabulary pass (logits in); it knows no backend details beyond a name."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.pass_options import PassOptions, RowCheck
from grpo_kernels.kernels.protocol import compute_dtype

TOKEN_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # optional outputs of the pass (TRL's names)


def backend_kernels(backend: str):
    """The module with `backend`'s vocabulary pass (`token_logprobs_fwd` / `token_logprobs_bwd`)."""
    return backends.kernels_of(backend)


def contiguous_vocab(logits: Tensor, backend: str) -> Tensor:
    """The logits as the backend reads them: with stride 1 along V where it needs that."""
    if backends.CAPABILITIES[backend].contiguous_vocab and logits.stride(-1) != 1:
        return logits.contiguous()
    return logits


class _TokenLogprobsFunction(torch.autograd.Function):
    """logits [B, T, V] -> (logp [B, T], entropy [B, T] or empty, *the asked statistics [B, T], not differentiable);
    saves O(B·T) statistics, never [B, T, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions):
        logits = contiguous_vocab(logits, opts.backend)
        logp, lse, entropy, stats = _pass_forward(logits, targets, mask, opts)
        if entropy is None:
            entropy = logp.new_empty(0)
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))  # one call: each replaces
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, mask, lse, entropy)
        ctx.opts = opts
        ctx.consumed = False
        return logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None, *_grad_stats):
        opts: PassOptions = ctx.opts
        consume(ctx)
        logits, targets, mask, lse, entropy = ctx.saved_tensors
        if not opts.with_entropy:
            grad_entropy, entropy = None, None
        version = logits._version
        out = in_place_or_new(ctx, logits)
        backends.count_launch(opts.backend)
        backend_kernels(opts.backend).token_logprobs_bwd(
            logits, targets, mask, lse, entropy, grad_logp, grad_entropy, opts.temperature, out, **opts.transform()
        )
        mark_overwritten(ctx, logits, version)
        return out, None, None, None


def _pass_forward(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions):
    """The backend's forward pass, its rows checked: logp, lse, entropy or None, [the asked statistics]."""
    check_not_overwritten(logits)
    backends.count_launch(opts.backend)
    logp, lse, entropy, stats = backend_kernels(opts.backend).token_logprobs_fwd(
        logits, targets, mask, opts.temperature, opts.with_entropy, **opts.transform(), stats=opts.stats
    )
    logp = checked_rows(opts.row_check, lse, logp, None)  # masked rows are 0 (`protocol.VocabPass`)
    return logp, lse, entropy, [stats[name] for name in opts.stats]


def logits_pass(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions) -> dict[str, Tensor]:
    """Run the pass on checked [B, T, V] logits: {"logp", "entropy" (if asked), each of `opts.stats`}, all [B, T];
    the statistics (see `token_logprobs`) carry no gradient. Without a gradient to take, no autograd Function."""
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, entropy, *stats = _TokenLogprobsFunction.apply(logits, targets, mask, opts)
    else:
        logp, _, entropy, stats = _pass_forward(contiguous_vocab(logits, opts.backend), targets, mask, opts)
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    return out | dict(zip(opts.stats, stats, strict=True))


def consume(ctx) -> None:
    """Refuse a second in-place backward (the first overwrote the saved logits), before touching saved tensors."""
    if ctx.consumed and ctx.opts.inplace:
        raise RuntimeError(
            "the in-place backward already overwrote these logits with their gradient; "
            "pass inplace=False to backpropagate through them more than once"
        )
    ctx.consumed = True


def in_place_or_new(ctx, logits: Tensor) -> Tensor:
    """The buffer the backward writes dL/dlogits into: the logits themselves unless `inplace=False`."""
    if ctx.opts.inplace:  # triton's forward made the saved logits contiguous in V; torch takes any strides
        torch.autograd.graph.increment_version(logits)  # anything else that saved these logits now errors
        return logits
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# The in-place contract: an in-place backward leaves dL/dlogits in the logits' buffer, and records on its storage
# the version counter it left and the bytes it wrote. A later pass over those bytes at that version (the same
# tensor, or any view of the buffer not written since) is an error; a write (a new forward, copy_) bumps the
# version and clears it. Spans keep micro-batches carved from one buffer apart.
_OVERWRITTEN = "_grpo_kernels_overwritten"  # storage attribute: (version, ((first byte, last byte), ...))


def _byte_span(x: Tensor) -> tuple[int, int]:
    """The first and last byte of its storage that x may touch (an empty x: an empty span)."""
    size = x.element_size()
    extent = sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True)) + 1 if x.numel() else 0
    return x.storage_offset() * size, (x.storage_offset() + extent) * size - 1


def mark_overwritten(ctx, logits: Tensor, version: int) -> None:
    """After an in-place backward that found the logits at `version`: record what it overwrote (not under
    torch.compile, which cannot trace the mark on the storage)."""
    if not ctx.opts.inplace or torch.compiler.is_compiling():
        return
    storage = logits.untyped_storage()
    recorded, spans = getattr(storage, _OVERWRITTEN, (None, ()))
    spans = spans if recorded == version else ()  # written since: the older spans hold new values
    setattr(storage, _OVERWRITTEN, (logits._version, (*spans, _byte_span(logits))))


def check_not_overwritten(logits: Tensor) -> None:
    """ValueError if an in-place backward overwrote these logits with their gradient and nothing wrote them since.
    Not under torch.compile, which cannot trace the mark on the storage (nor an in-place backward write it)."""
    if torch.compiler.is_compiling():
        return
    recorded, spans = getattr(logits.untyped_storage(), _OVERWRITTEN, (None, ()))
    if recorded != logits._version:
        return
    first, last = _byte_span(logits)
    if any(first <= end and start <= last for start, end in spans):
        raise ValueError(
            "logits hold the gradient an earlier in-place backward wrote into them (inplace=True consumes the "
            "logits); compute the logits again, or pass inplace=False to the call whose backward consumed them"
        )


def checked_rows(row_check: RowCheck | None, lse: Tensor, logp: Tensor, kept: Tensor | None) -> Tensor:
    """The pass's logp, its kept rows checked by `row_check` (the engine's); unchecked (None), NaN where the row's
    lse is not finite, so that a loss on it is NaN too, never finite over non-finite gradients."""
    if row_check is not None:
        row_check(lse, logp, kept)
        return logp
    if kept is None:  # 2 ops: at small shapes ops are the cost
        return not_finite_to_nan(logp, lse)
    return logp.masked_fill(~torch.isfinite(lse) & kept, float("nan"))


def poisoned(loss: Tensor, bad: Tensor) -> Tensor:
    """`loss`, or NaN when a `bad` flag is set (a kept row whose gradient is not finite); no host sync."""
    return torch.where(bad.any(), torch.full_like(loss, float("nan")), loss)


def not_finite_to_nan(x: Tensor, total: Tensor) -> Tensor:
    """`x`, NaN where `total` (of x's shape, or broadcast to it) is not finite: total − total is 0 or NaN; no host
    sync."""
    return x + (total - total)


def nonfinite_rows(lse: Tensor, logp: Tensor, *per_row: Tensor | None) -> Tensor:
    """Rows with a non-finite lse, a NaN logp or a non-finite value in any of `per_row` (dL/dlogp, dL/dH, the
    loss's inputs; None passes), each of lse's shape or broadcast to it."""
    total = lse.clone()  # a sum is finite iff its terms are (these are O(1e4) at most: no overflow)
    for x in per_row:
        if x is not None:
            total.add_(x)
    return ~torch.isfinite(total) | torch.isnan(logp)


class _FusedTokenLossFunction(torch.autograd.Function):
    """logits [B, T, V] -> (loss, logp [B, T], entropy [B, T] or empty) with the token-level loss formed in the
    forward pass's epilogue; the backward scales the saved dL/dlogp and runs the vocabulary backward."""

    @staticmethod
    def forward(ctx, logits, targets, mask, weights, advantages, old_logp, ref_logp, is_ratio, opts, epilogue):
        check_not_overwritten(logits)
        logits = contiguous_vocab(logits, opts.backend)
        backends.count_launch(opts.backend)
        backends.count_launch("fused_epilogue")
        logp, lse, entropy, loss, dlogp = backends.kernels_of(opts.backend, "epilogue_module").grpo_loss_fwd(
            logits,
            targets,
            mask,
            weights,
            advantages,
            old_logp,
            ref_logp,
            is_ratio,
            epilogue,
            opts.temperature,
            opts.with_entropy,
            **opts.transform(),
        )
        logp = checked_rows(opts.row_check, lse, logp, None)  # masked rows are 0 (`protocol.Epilogue`)
        entropy = logp.new_empty(0) if entropy is None else entropy
        ctx.mark_non_differentiable(logp, entropy)
        ctx.save_for_backward(logits, targets, mask, lse, dlogp)
        ctx.opts = opts
        ctx.consumed = False
        # a kept row with a non-finite input or dL/dlogits makes the loss NaN (as the PyTorch algebra does), never
        # a finite loss over NaN gradients (a kernel's min/max may drop NaN)
        if opts.row_check is not None:  # the inputs and the rows were checked: only dL/dlogp can still overflow
            return not_finite_to_nan(loss.sum(), dlogp.sum()), logp, entropy  # dlogp is 0 at masked rows
        bad = nonfinite_rows(lse, logp, dlogp, weights, advantages, old_logp, ref_logp, is_ratio) & mask
        return poisoned(loss.sum(), bad), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        consume(ctx)
        logits, targets, mask, lse, dlogp = ctx.saved_tensors
        version = logits._version
        out = in_place_or_new(ctx, logits)
        backends.count_launch(ctx.opts.backend)
        backend_kernels(ctx.opts.backend).token_logprobs_bwd(
            logits, targets, mask, lse, None, dlogp * grad_loss, None, ctx.opts.temperature, out, **ctx.opts.transform()
        )
        mark_overwritten(ctx, logits, version)
        return out, *(None,) * 9


def fused_token_loss(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    weights: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    opts: PassOptions,
    epilogue,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss (0-dim) of a token-level variant in one kernel pass, plus detached logp and entropy [B, T] for metrics.

    weights [B, T] are the normaliser's per-token weights; advantages / is_ratio may be [B, 1] or [B, T];
    `epilogue` the loss's record of flags and constants (`losses.epilogue.TokenEpilogue`: its `kind`, clip widths,
    KL estimator...), read by the backend's `grpo_loss_fwd`.
    """
    B, T = mask.shape
    dtype = compute_dtype(logits.dtype)  # float64 on torch for float64 logits
    side = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    expand = lambda x: None if x is None else x.to(dtype).expand(B, T)  # noqa: E731
    loss, logp, entropy = _FusedTokenLossFunction.apply(
        logits,
        targets,
        mask,
        side(weights),
        expand(advantages),
        side(old_logp),
        side(ref_logp),
        expand(is_ratio),
        opts,
        epilogue,
    )
    return loss, logp, (entropy if opts.with_entropy else None)

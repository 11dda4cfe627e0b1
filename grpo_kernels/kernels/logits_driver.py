"""The one autograd Function of the vocabulary pass on logits [B, T, V] (a vocabulary shard's [B, T, V_r]): a loop over
windows of rows that calls two steps the plan chose.

- The support: the whole vocabulary (one window, the logits as they are, the backend's pass on them; with a fused
  loss epilogue, `losses/epilogue.py`'s record, its forward kernel also forms each token's loss and dL/dlogp), or
  sampling replay (`replay.ReplayedRows`: windows masked in a scratch, never [B, T, V]).
- The placement: one process, or a vocabulary shard whose statistics merge over its group (`parallel.Placement`).

The forward saves O(B·T) statistics (and replay's per-row θ), never [B, T, V] beyond the logits themselves; the
backward writes dL/dlogits into the logits' own buffer unless `inplace=False` (the in-place contract below).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels import replay
from grpo_kernels.kernels.parallel import Placement, VocabShard
from grpo_kernels.kernels.pass_options import PassOptions, RowCheck
from grpo_kernels.kernels.protocol import LossSides, RowGrads, VocabPassArgs, compute_dtype


@dataclass(frozen=True)
class LogitsPass:
    """One pass of the driver: its options, the vocabulary shard (None: one process) and a token-level loss's
    epilogue record (None: log-probs out, else the loss's side tensors follow the logits into the Function)."""

    opts: PassOptions
    shard: VocabShard | None = None
    epilogue: Any = None


class _LogitsFunction(torch.autograd.Function):
    """(logits, targets, mask, pass, *the epilogue's side tensors) -> (loss, logp [B, T], entropy [B, T] or empty,
    *the asked statistics [B, T], not differentiable); the loss is 0-dim with an epilogue (then logp and entropy
    are not differentiable), else None."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, spec: LogitsPass, *side: Tensor | None):
        logits, place, loss, logp, lse, entropy, stats, saved = _forward(logits, targets, mask, spec, side)
        entropy = logp.new_empty(0) if entropy is None else entropy
        if spec.epilogue is not None:
            ctx.mark_non_differentiable(logp, entropy)
        else:
            ctx.mark_non_differentiable(*stats, *([] if spec.opts.with_entropy else [entropy]))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, lse, entropy, saved)
        ctx.opts, ctx.spec, ctx.place, ctx.consumed = spec.opts, spec, place, False  # place: inputs and O(B·T)
        return loss, logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_loss: Tensor | None, grad_logp: Tensor | None, grad_entropy: Tensor | None, *_stats):
        spec: LogitsPass = ctx.spec
        if spec.epilogue is not None and grad_loss is None:  # the loss reaches no output: no gradient
            return (None,) * len(ctx.needs_input_grad)
        consume(ctx)
        logits, lse, entropy, saved = ctx.saved_tensors
        if spec.epilogue is not None:  # dL/dlogp came out of the forward: scaled, no entropy term
            grad_logp, grad_entropy = saved * grad_loss, None
        if grad_entropy is None or not spec.opts.with_entropy:
            grad_entropy, entropy = None, None
        version = logits._version
        out = in_place_or_new(ctx, logits)
        kernels, place = backends.launch(spec.opts.backend), ctx.place
        if spec.opts.replay is None:
            grads = {"lse": lse, "entropy": entropy, "grad_logp": grad_logp, "grad_entropy": grad_entropy}
            _whole_backward(kernels, logits, out, place, spec.opts, **grads)
        else:
            rows = replay.ReplayedRows(logits, place, spec.opts)
            rows.backward(
                kernels, out, lse=lse, entropy=entropy, grad_logp=grad_logp, grad_entropy=grad_entropy, theta=saved
            )
        mark_overwritten(ctx, logits, version)
        return out, None, None, None, *(None,) * len(ctx.needs_input_grad[4:])


def _forward(logits: Tensor, targets: Tensor, mask: Tensor, spec: LogitsPass, side: tuple):
    """(the logits as the backend read them, the rows' `Placement`, loss or None, logp, lse, entropy or None,
    [statistics], what the backward reads besides: the epilogue's dL/dlogp, replay's θ, or None), every per-row
    value [B, T]; the rows checked."""
    opts = spec.opts
    check_not_overwritten(logits)
    logits = contiguous_vocab(logits, opts.backend)
    place = Placement(targets, mask) if spec.shard is None else spec.shard.placement(targets, mask)
    loss = saved = None
    if spec.epilogue is not None:  # the whole vocabulary, one process (the plan's route)
        epilogue = backends.launch(opts.backend, "epilogue_module", also="fused_epilogue")
        args = VocabPassArgs(logits=logits, targets=targets, mask=mask, **{**opts.pass_fields, "stats": ()})
        logp, lse, entropy, losses, saved = epilogue.grpo_loss_fwd(args, LossSides(*side), spec.epilogue)
        loss = _checked_loss(losses, logp=logp, lse=lse, dlogp=saved, mask=mask, side=side, row_check=opts.row_check)
        stats = {}
    elif opts.replay is None:
        kernels = backends.launch(opts.backend)
        stats = opts.stats if place.shard is None else ()
        args = VocabPassArgs(logits=logits, targets=place.targets, mask=mask, **{**opts.pass_fields, "stats": stats})
        logp, lse, entropy, stats = kernels.token_logprobs_fwd(args)
    else:
        rows = replay.ReplayedRows(logits, place, opts)
        logp, lse, entropy, stats, saved = rows.forward(backends.launch(opts.backend))
    if place.shard is not None:
        lse, logp, entropy, stats = place.merge(lse=lse, logp=logp, entropy=entropy, stats=stats, opts=opts)
    logp = checked_rows(opts.row_check, lse, logp, None if place.shard is None else mask)
    return logits, place, loss, logp, lse, entropy, [stats[name] for name in opts.stats], saved


def _whole_backward(kernels, logits, out, place: Placement, opts, *, lse, entropy, grad_logp, grad_entropy) -> None:
    """The backend's backward over the whole logits into `out`; on a shard the one-hot of the rows whose target
    another shard owns taken back out (`parallel.Placement.remove_foreign`)."""
    x0 = None if place.shard is None else logits[..., 0].clone()  # column 0 before an in-place backward writes it
    grads = RowGrads(lse=lse, entropy=entropy, grad_logp=grad_logp, grad_entropy=grad_entropy)
    args = VocabPassArgs(logits=logits, targets=place.targets, mask=place.mask, **opts.pass_fields)
    kernels.token_logprobs_bwd(args, grads, out)
    if x0 is not None:
        place.remove_foreign(out, x0, grad_logp, opts)


def _checked_loss(losses, *, logp, lse, dlogp, mask, side, row_check: RowCheck | None) -> Tensor:
    """The epilogue's summed loss; NaN when a kept row has a non-finite input or dL/dlogits (as the PyTorch algebra
    gives), never a finite loss over NaN gradients (a kernel's min/max may drop NaN)."""
    if row_check is not None:  # the inputs and the rows were checked: only dL/dlogp can still overflow
        return not_finite_to_nan(losses.sum(), dlogp.sum())  # dlogp is 0 at masked rows
    return poisoned(losses.sum(), nonfinite_rows(lse, logp, dlogp, *side) & mask)


def logits_pass(
    logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions, shard: VocabShard | None = None
) -> dict[str, Tensor]:
    """The pass on checked [B, T, V] logits (a shard's [B, T, V_r] with `shard`; targets whole-vocabulary ids):
    {"logp", "entropy" (if asked), each of `opts.stats`}, all [B, T]; the statistics carry no gradient. Without a
    gradient to take, no autograd Function. With replay's `full_entropy` the entropy comes from an ordinary pass
    beside the replayed one (neither in place: both backward passes read the logits)."""
    full = opts.replay is not None and opts.replay.full_entropy and opts.with_entropy
    if full:
        plain = PassOptions(
            opts.backend, opts.temperature, True, opts.logit_scale, opts.final_logit_softcapping, inplace=False
        )
        entropy = logits_pass(logits, targets, mask, plain, shard)["entropy"]
        opts = dataclasses.replace(opts, with_entropy=False, inplace=False)
    spec = LogitsPass(opts, shard)
    if torch.is_grad_enabled() and logits.requires_grad:
        _, logp, *outputs = _LogitsFunction.apply(logits, targets, mask, spec)
    else:
        _, _, _, logp, _, entropy_or_none, stats, _ = _forward(logits, targets, mask, spec, ())
        outputs = [entropy_or_none, *stats]
    out = {"logp": logp} | ({"entropy": outputs[0]} if opts.with_entropy else {})
    out |= dict(zip(opts.stats, outputs[1:], strict=True))
    return out | ({"entropy": entropy} if full else {})


def fused_token_loss(
    logits: Tensor, targets: Tensor, mask: Tensor, sides: LossSides, *, opts: PassOptions, epilogue
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss (0-dim) of a token-level variant in one kernel pass, plus detached logp and entropy [B, T] for metrics;
    `epilogue` the loss's record of flags and constants (`losses.epilogue.TokenEpilogue`: its `kind`, clip widths,
    KL estimator...), read by the backend's `grpo_loss_fwd`."""
    B, T = mask.shape
    dtype = compute_dtype(logits.dtype)  # float64 on torch for float64 logits
    side = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    expand = lambda x: None if x is None else x.to(dtype).expand(B, T)  # noqa: E731
    per_row = (side(sides.weights), expand(sides.advantages), side(sides.old_logp), side(sides.ref_logp))
    sides = (*per_row, expand(sides.is_ratio))
    loss, logp, entropy = _LogitsFunction.apply(logits, targets, mask, LogitsPass(opts, None, epilogue), *sides)
    return loss, logp, (entropy if opts.with_entropy else None)


def contiguous_vocab(logits: Tensor, backend: str) -> Tensor:
    """The logits as the backend reads them: with stride 1 along V where it needs that."""
    if backends.CAPABILITIES[backend].contiguous_vocab and logits.stride(-1) != 1:
        return logits.contiguous()
    return logits


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

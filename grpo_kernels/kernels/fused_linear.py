"""The vocabulary pass fused with the lm_head: hidden [M, H] and weight [V, H] in; the [M, V] logits only ever
exist one chunk of rows at a time, so memory beyond the gradients is one chunk.

One autograd Function, one loop over row chunks. Per chunk: one GEMM for the logits, the backend's vocabulary pass on
them (in place), and the two gradient GEMMs (dH chunk, dW accumulated in float32 and cast once). On CUDA every GEMM
reads its operands in the input dtype (tensor cores) with float32 accumulation (`gemm_mode`). Two schedules of the
same loop (`LinearPass.chunk_loss`):
- log-probs out (logp, entropy), any loss on top; the backward recomputes each chunk's logits (4 GEMMs in all);
- a token-level loss: its per-token dL/dlogp is known as soon as a chunk's log-probs are, so the gradients are formed
  in the forward from the logits still in memory and the backward only scales them: 3 GEMMs, the floor.
The loop's steps are the support (the whole vocabulary, or sampling replay: `replay.ReplayedChunks` masks each
chunk's logits to the sampler's support in their own buffer, a compute-dtype copy where `replay.masks_in_place`
says no, and masks them again in the 4-GEMM backward from each row's saved threshold) and the placement (the whole
weight, or a vocabulary shard, `parallel.Placement`: its statistics merged over the group once every chunk's are
in, dH all-reduced). `PassOptions.head_precision` sets the logits GEMM's dtype (`head_precision.py`); the gradient
GEMMs stay in the weight's.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels import head_precision, replay
from grpo_kernels.kernels.logits_driver import checked_rows, nonfinite_rows, not_finite_to_nan, poisoned
from grpo_kernels.kernels.parallel import Placement, VocabShard, reduce_hidden_grad
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import VocabPassArgs, compute_dtype
from grpo_kernels.kernels.replay import WindowGrads

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


def chunk_bounds(opts: PassOptions, num_rows: int) -> tuple[int, ...]:
    """The chunks' row offsets (0, .., num_rows): the engine's (`PassOptions.chunk_bounds`, e.g. chunks of whole
    sequences, each at most `chunk_size` rows: one buffer of `rows_per_chunk` rows serves them all), else
    `rows_per_chunk` rows each."""
    bounds = opts.chunk_bounds
    if bounds is None:
        return (*range(0, num_rows, rows_per_chunk(opts, num_rows)), num_rows)
    widths = [b - a for a, b in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != num_rows or not all(0 < w <= opts.chunk_size for w in widths):
        raise ValueError(
            f"PassOptions.chunk_bounds must rise from 0 to the {num_rows} rows by at most chunk_size="
            f"{opts.chunk_size}, got {bounds}"
        )
    return bounds


ChunkLoss = Callable[[slice, Tensor, Tensor | None], tuple[Tensor, Tensor | None, Tensor | None]]


class TokenLossStep:
    """A token-level loss formed chunk by chunk in a fused lm_head's forward, shared with the teacher term's two-head
    pass (`teacher_term.py`): each call adds a chunk's `chunk_loss` share to the loss and returns its (dL/dlogp,
    dL/dentropy or None) `[c]`; `loss()` is the sum, NaN where a kept row's gradient was not finite (non-finite
    gradients never hide in a finite loss). `checked`: the pass checks its rows' lse and logp itself (then only the
    gradients are watched, by their sum); else a flag of any kept row with a non-finite lse, logp or gradient."""

    def __init__(self, chunk_loss: ChunkLoss, checked: bool, dtype: torch.dtype, device: torch.device):
        self.chunk_loss, self.checked = chunk_loss, checked
        self.total = torch.zeros((), dtype=dtype, device=device)  # float64 stays so
        self.gradient_sum = torch.zeros_like(self.total)  # checked: Σ dL/dlogp + Σ dL/dentropy
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # unchecked: a flagged kept row

    def __call__(
        self, rows: slice, logp: Tensor, entropy: Tensor | None, lse: Tensor | None = None, kept: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The chunk's (dL/dlogp, dL/dentropy), `[c]` each, from its rows' logp and entropy (None when the loss reads
        none); unchecked, `lse` and the `kept` rows `[c]` (None: all) flag a non-finite row."""
        share, grad_logp, grad_entropy = self.chunk_loss(rows, logp, entropy)
        self.total += share
        if self.checked:
            for grad in (g for g in (grad_logp, grad_entropy) if g is not None):
                self.gradient_sum += grad.sum()
        else:
            flagged = nonfinite_rows(lse, logp, grad_logp, grad_entropy)
            self.bad |= (flagged if kept is None else flagged & kept).any()
        return grad_logp, grad_entropy

    def loss(self) -> Tensor:
        """The chunks' summed shares (0-d), NaN where a kept row's gradient was not finite; no host sync."""
        return not_finite_to_nan(self.total, self.gradient_sum) if self.checked else poisoned(self.total, self.bad)


def _cat(parts: list[Tensor], like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The chunks' per-row values as one [M] tensor; no chunks (M = 0, every token masked): an empty one."""
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=like.device)


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
        if grad_logits.dtype != weight.dtype:  # a head_precision's logits
            grad_logits = grad_logits.to(weight.dtype)
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


def _row_masks(rows: int, mask: Tensor | None, device) -> Callable[[slice], Tensor]:
    """The vocabulary pass's mask [1, c] for a chunk's rows: all kept (the rows were gathered), or `mask`'s."""
    if mask is not None:
        return lambda r: mask[None, r]
    ones = torch.ones((1, rows), dtype=torch.bool, device=device)
    return lambda r: ones[:, : r.stop - r.start]


@dataclass(frozen=True)
class LinearPass:
    """One pass of the fused lm_head: its options; the vocabulary shard (None: the whole weight), whose dH is
    all-reduced over the group unless `reduce_hidden_grad` is False (`parallel.partial_hidden_grad`); and a
    token-level loss given as `chunk_loss(rows, logp_rows, entropy_rows or None)` -> (its share of the loss,
    dL/dlogp, dL/dentropy or None), [c] each, giving the rows the row mask drops no loss and no gradient (None:
    log-probs out, the backward recomputes each chunk's logits)."""

    opts: PassOptions
    shard: VocabShard | None = None
    chunk_loss: ChunkLoss | None = None
    reduce_hidden_grad: bool = True


class _FusedLinearFunction(torch.autograd.Function):
    """(hidden [M, H], weight [V, H] (a shard's [V_r, H]), bias [V] | None, targets [M] whole-vocabulary ids,
    row_mask [M] bool | None, pass) -> (loss, logp [M], entropy [M] or empty, each asked statistic [M], not
    differentiable). row_mask None: every row is kept; else the rows it drops give 0 and no gradient. With a
    `chunk_loss` the loss is 0-dim and its gradients are formed in the forward from each chunk's logits still in
    memory (3 GEMMs, the backward scales them; logp and entropy are not differentiable); else the loss is None
    and the backward recomputes each chunk's logits (4 GEMMs)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, spec: LinearPass):
        opts = spec.opts
        in_forward = spec.chunk_loss is not None
        chunks = _Chunks(hidden, weight, bias, targets, row_mask, spec)
        passes = len(chunks) * (2 if in_forward else 1)  # a pass per chunk; with the loss, its backward too
        kernels = backends.launch(opts.backend, passes=passes, also="fused_linear_token_loss" if in_forward else None)
        sink = _GradientSink(hidden, weight, bias, ctx.needs_input_grad[:3]) if in_forward else None
        if in_forward:  # a kept row with a non-finite dL/dlogits makes the loss NaN
            dtype = compute_dtype(chunks.w.dtype)
            step = TokenLossStep(spec.chunk_loss, opts.row_check is not None, dtype, hidden.device)
        found: dict[str, list[Tensor]] = {"logp": [], "lse": [], **({"entropy": []} if opts.with_entropy else {})}
        for r in chunks:
            z, mask, rows_targets = (
                chunks.logits(r),
                chunks.masks(r),
                chunks.place.targets[None, r],
            )  # [1, c, V], [1, c]
            logp, lse, entropy, stats, state = chunks.forward(kernels, z, r, rows_targets, mask)
            for name, x in {"logp": logp, "lse": lse, "entropy": entropy, **stats}.items():
                if x is not None:
                    found.setdefault(name, []).append(x[0])
            if not in_forward:
                continue
            grad_logp, grad_entropy = step(r, logp[0], entropy[0] if opts.with_entropy else None, lse[0], mask[0])
            one = lambda x: None if x is None else x[None]  # noqa: E731  [1, c]
            grads = WindowGrads(
                targets=rows_targets,
                mask=mask,
                lse=lse,
                entropy=entropy if grad_entropy is not None else None,
                grad_logp=one(grad_logp),
                grad_entropy=one(grad_entropy),
            )
            sink.add(r, chunks.grad(kernels, z, r, grads, state), hidden[r], weight)
        lse, logp, entropy, stats = chunks.merged(found, hidden)
        logp = checked_rows(opts.row_check, lse, logp, row_mask)
        stats = [stats[name] for name in opts.stats]
        ctx.set_materialize_grads(False)
        if in_forward:
            ctx.sink, ctx.weight_like = sink, (weight, bias)
            ctx.mark_non_differentiable(logp, entropy, *stats)
            return step.loss(), logp, entropy, *stats
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))
        ctx.save_for_backward(hidden, weight, bias, targets, row_mask, lse, entropy)
        ctx.spec, ctx.replayed = spec, chunks.saved()
        return None, logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, grad_entropy, *_grad_stats):
        if getattr(ctx, "sink", None) is not None:  # formed in the forward: scaled
            (weight, bias), sink = ctx.weight_like, ctx.sink
            ctx.sink = None
            return (*sink.result(weight, bias, scale=grad_loss), None, None, None)
        hidden, weight, bias, targets, row_mask, lse, entropy = ctx.saved_tensors
        spec: LinearPass = ctx.spec
        if not spec.opts.with_entropy:
            grad_entropy = None
        chunks = _Chunks(hidden, weight, bias, targets, row_mask, spec, ctx.replayed)
        kernels = backends.launch(spec.opts.backend, passes=len(chunks))
        sink = _GradientSink(hidden, weight, bias, ctx.needs_input_grad[:3])
        for r in chunks:
            z, mask = chunks.logits(r), chunks.masks(r)  # [1, c, V], overwritten by its gradient
            pick = lambda x, r=r: None if x is None else x[None, r]  # noqa: E731  [1, c]
            grads = WindowGrads(
                targets=chunks.place.targets[None, r],
                mask=mask,
                lse=lse[None, r],
                entropy=pick(entropy if grad_entropy is not None else None),
                grad_logp=pick(grad_logp),
                grad_entropy=pick(grad_entropy),
            )
            sink.add(r, chunks.grad(kernels, z, r, grads), hidden[r], weight)
        grad_hidden, grad_weight, grad_bias = sink.result(weight, bias)
        if grad_hidden is not None and spec.shard is not None and spec.reduce_hidden_grad:
            dist.all_reduce(grad_hidden, group=spec.shard.group)
        return grad_hidden, grad_weight, grad_bias, None, None, None


class _Chunks:
    """The fused lm_head's row chunks and the steps each takes: its logits (one GEMM into one buffer), the support
    (the whole vocabulary, the backend's pass on the chunk; or sampling replay, `replay.ReplayedChunks`) and the
    placement (the whole weight, or a vocabulary shard merged over its group, `parallel.Placement`)."""

    def __init__(self, hidden, weight, bias, targets, row_mask, spec: LinearPass, replayed=(None, None)):
        self.opts, self.hidden, M = spec.opts, hidden, targets.shape[0]
        self.w, self.b = head_precision.operands(weight, bias, self.opts.head_precision)
        self.bounds = chunk_bounds(self.opts, M)
        self.rows = rows_per_chunk(self.opts, M)  # rows of the widest chunk at most
        mask = row_mask
        if spec.shard is not None and mask is None:  # the merge reads every row's flag
            mask = torch.ones(M, dtype=torch.bool, device=hidden.device)
        self.place = Placement(targets, mask) if spec.shard is None else spec.shard.placement(targets, mask)
        self.masks = _row_masks(self.rows, mask, hidden.device)
        self.buffer = self.w.new_empty(self.rows, weight.shape[0])  # [rows, V]: one buffer serves every chunk
        self.replay = None
        if self.opts.replay is not None:
            self.replay = replay.ReplayedChunks(self.opts, self.place, self.rows, weight, replayed)

    def __iter__(self):
        for i in range(len(self.bounds) - 1):
            yield slice(self.bounds[i], self.bounds[i + 1])

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def logits(self, r: slice) -> Tensor:
        """The chunk's logits [1, c, V] for its hidden rows, in the buffer (a fresh allocation per chunk pays its
        page faults again on CPU each time)."""
        out = self.buffer[: r.stop - r.start]
        return head_precision.logits_gemm(
            self.hidden[r], self.w, self.b, out=out, head_precision=self.opts.head_precision
        )[None]

    def forward(self, kernels, z: Tensor, r: slice, targets: Tensor, mask: Tensor):
        """(logp, lse, entropy or None, {statistic}, replay's state), [1, c] each, of the chunk z [1, c, V] (targets
        and mask [1, c]): the statistics of `opts.stats` on one process, a shard's replay statistics ("lse_full",
        "outside") for the merge."""
        opts, place = self.opts, self.place
        if self.replay is not None:
            return self.replay.forward(kernels, z, r, mask)
        stats = opts.stats if place.shard is None else ()
        args = VocabPassArgs(logits=z, targets=targets, mask=mask, **{**opts.pass_fields, "stats": stats})
        return *kernels.token_logprobs_fwd(args), None

    def grad(self, kernels, z: Tensor, r: slice, grads: WindowGrads, state=None) -> Tensor:
        """dL/dlogits [c, V] of the chunk z [1, c, V] (in its buffer, or replay's scratch) from its rows' `grads`
        [1, c]; on a shard without the one-hot of the rows whose target another shard owns."""
        opts, place = self.opts, self.place
        if self.replay is not None:
            rows = grads.at(0)  # [c] each
            return self.replay.grad(kernels, z, r, rows, state, place.foreign(rows.grad_logp, r))
        x0 = None if place.shard is None else z[..., 0].clone()  # [1, c]: column 0 before the backward writes it
        args = VocabPassArgs(logits=z, targets=grads.targets, mask=grads.mask, **opts.pass_fields)
        kernels.token_logprobs_bwd(args, grads, z)
        if x0 is not None:
            place.remove_foreign(z, x0, grads.grad_logp, opts, r)
        return z[0]

    def merged(self, found: dict[str, list[Tensor]], like: Tensor):
        """The chunks' per-row values joined, [M] each: (lse, logp, entropy or empty, {statistic}), merged over
        the shard's group on a vocabulary shard."""
        bools = ("is_top1", "outside_support", "outside")
        joined = {
            name: _cat(parts, like, torch.bool if name in bools else torch.float32) for name, parts in found.items()
        }
        lse, logp, entropy = joined.pop("lse"), joined.pop("logp"), joined.pop("entropy", None)
        if self.place.shard is not None:
            lse, logp, entropy, joined = self.place.merge(
                lse=lse, logp=logp, entropy=entropy, stats=joined, opts=self.opts
            )
        for name in self.opts.stats:  # no chunks (every row dropped): empty statistics
            joined.setdefault(name, _cat([], like, torch.bool if name in bools else torch.float32))
        return lse, logp, logp.new_empty(0) if entropy is None else entropy, joined

    def saved(self):
        """What the backward's replay reads: each row's θ [M, 1] and the full pass's lse [1, M] (None where none)."""
        return (None, None) if self.replay is None else self.replay.saved()


def fused_linear_logprobs(
    hidden, weight, bias, targets, *, opts: PassOptions, row_mask: Tensor | None = None, shard: VocabShard | None = None
) -> dict[str, Tensor]:
    """{"logp", "entropy" (if asked), each of `opts.stats`}, all [M], of the rows (0 where `row_mask` drops one), in
    row chunks ("fast" memory); differentiable in hidden, weight, bias (the statistics are not). On a vocabulary
    shard of the weight (`shard`) over the whole vocabulary: dW and db of the shard, dH summed over the group
    (inside `parallel.partial_hidden_grad`: this rank's share of it)."""
    spec = LinearPass(opts, shard, reduce_hidden_grad=shard is None or reduce_hidden_grad())
    _, *outputs = _FusedLinearFunction.apply(hidden, weight, bias, targets, row_mask, spec)
    return named_outputs(opts, *outputs)


def named_outputs(opts: PassOptions, logp: Tensor, entropy: Tensor, *stats: Tensor) -> dict[str, Tensor]:
    """A log-prob Function's outputs by name: "logp", "entropy" (if asked), each of `opts.stats`."""
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    return out | dict(zip(opts.stats, stats, strict=True))


def fused_linear_token_loss(
    hidden, weight, bias, targets, *, opts: PassOptions, chunk_loss: ChunkLoss, row_mask: Tensor | None = None
):
    """(loss, detached logp [M], detached entropy [M] | None, {each of `opts.stats`: [M]}) of a token-level loss,
    gradients formed in forward."""
    spec = LinearPass(opts, chunk_loss=chunk_loss)
    loss, logp, entropy, *stats = _FusedLinearFunction.apply(hidden, weight, bias, targets, row_mask, spec)
    return loss, logp, (entropy if opts.with_entropy else None), dict(zip(opts.stats, stats, strict=True))

"""Plan: one call, decided once. Building it resolves the backend, checks everything (`validate.check_call`, one
call), lays the tokens out (`layout.lay_out`, one call), reads every value check with one host sync, gathers the kept
rows, sets the row-blame policy and chooses the route; `routes.run` runs that route (`engine/routes.py`) and gives
the results the user's shapes back.

A public function is "build the plan, run it": `routes.run(build_plan(...))`, a loss call's plan with its
LossOptions; `Source` says whether logits or an lm_head feed the pass.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.engine import finite, memory, sync, validate
from grpo_kernels.engine import replay as replay_module
from grpo_kernels.engine.inputs import LossInputs, LossTensors, TokenTensors
from grpo_kernels.engine.layout import Layout, lay_out
from grpo_kernels.kernels import parallel
from grpo_kernels.kernels.backend import CAPABILITIES, resolve_backend
from grpo_kernels.kernels.head_precision import logits_dtype
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.losses import epilogue
from grpo_kernels.options import LossOptions


class Route(enum.Enum):
    """How a call runs (`routes.py` has one function each, and `routes.run` runs a plan)."""

    LOGPROBS = "logprobs"  # the vocabulary pass alone
    TWO_PHASE = "two_phase"  # the pass, then the loss algebra on its log-probs
    FUSED_EPILOGUE = "fused_epilogue"  # logits in: a token-level loss formed in the forward kernel's epilogue
    LINEAR_TOKEN_LOSS = "linear_token_loss"  # fused lm_head: a token-level loss's gradients formed in forward


@dataclass(frozen=True)
class Source:
    """What the vocabulary pass reads: logits `[.., V]`, or hidden states `[.., H]` through an lm_head weight
    `[V, H]` (and bias `[V]`), whose logits exist one chunk at a time."""

    x: Tensor
    weight: Tensor | None = None
    bias: Tensor | None = None

    @property
    def name(self) -> str:
        return "logits" if self.weight is None else "hidden"

    @property
    def local_vocab(self) -> int:
        """V of these logits or this lm_head (this rank's shard of the vocabulary with a process group)."""
        return self.x.shape[-1] if self.weight is None else self.weight.shape[0]

    @property
    def takes_grad(self) -> bool:
        """Whether autograd can ask the pass for a gradient: grad mode on and an input that requires one."""
        inputs = (self.x, self.weight, self.bias)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


@dataclass(frozen=True)
class Request:
    """How the caller asked the call to run: the public functions' keywords besides the tensors and loss options.
    A log-prob call gives the logit transform here; a loss call takes it from its LossOptions."""

    backend: str = "auto"
    check_finite: bool = True
    with_entropy: bool = False
    stats: tuple[str, ...] = ()
    inplace: bool = True
    chunk_size: int | None = None
    memory: str = "auto"
    tile: tuple[int, int] | None = None
    process_group: Any = None
    vocab_start: int | None = None
    sequence_group: Any = None
    return_sequence_losses: bool = False
    return_logprobs: bool = False
    temperature: float = 1.0
    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None
    head_precision: str = "auto"
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass(frozen=True)
class KeptRows:
    """The rows the fused lm_head runs: `index` (r, c) into the [R, C] rows, in order; `row_mask` [M] None when
    only kept rows were gathered, else every row runs and it marks the kept ones (`routes.py` takes and scatters)."""

    index: tuple[Tensor, Tensor]
    row_mask: Tensor | None


@dataclass(frozen=True)
class Plan:
    """Everything a call decided before any kernel runs."""

    route: Route
    source: Source
    layout: Layout  # the rows, mask and targets the pass reads, and the padded view
    kept: KeptRows | None  # the rows the fused lm_head runs; None: logits in
    shard: parallel.VocabShard | None  # this rank's vocabulary shard (process_group)
    pass_options: PassOptions
    options: LossOptions | None = None  # a loss call's
    inputs: LossInputs | None = None  # a loss call's checked tensors
    return_sequence_losses: bool = False
    return_logprobs: bool = False
    old_pass: bool = False  # π_old from a no-grad pass over the kept rows first (`_own_ratio_chunks`)
    stats: tuple[str, ...] = ()  # the statistics the caller asked for (the pass may compute more)


def build_plan(*, source: Source, arguments: dict[str, Any], options: LossOptions | None = None) -> Plan:
    """The plan of a public call from its `arguments` (the public function's, types checked), a loss call's with its
    `options`. It resolves the backend, checks the call (`validate.check_call`), lays the tokens out once
    (`layout.lay_out`), reads every value check with one host sync, sets the pass's options and chooses the route."""
    loss = options is not None
    tensors = _named(LossTensors if loss else TokenTensors, arguments)
    request = _named(Request, arguments)
    transform = options if loss else request  # where the logit transform comes from
    x, weight, device = source.x, source.weight, source.x.device
    backend = resolve_backend(request.backend, device)
    shard = parallel.vocab_shard(request.process_group, source.local_vocab, request.vocab_start, request.stats)
    vocab = source.local_vocab if shard is None else shard.vocab
    checked = validate.check_call(
        x, weight, source.bias, tensors, request, options=options, backend=backend, vocab=vocab
    )
    layout = lay_out(
        x,
        tensors.targets,
        tensors.mask,
        tensors.cu_seqlens,
        vocab=vocab,
        check_finite=request.check_finite,
        loss=loss,
        linear=weight is not None,
    )
    inputs, checks = None, list(checked.checks)
    if loss:
        inputs, input_checks = LossInputs.of(  # with the rollout correction of the inputs alone, before the pass
            tensors, layout, options, check_finite=request.check_finite, sequence_group=request.sequence_group
        )
        checks += input_checks
    gather = weight is not None and not layout.all_rows and not torch.compiler.is_compiling()
    # compiled, every row runs masked: a count read on the host would break the graph
    own_sequence_ratio = (  # padded rows only: packed ones keep the no-grad pass (`_own_ratio_chunks`)
        gather and loss and inputs.ratio_reads_pass and inputs.sampler_correction.per_sequence and not layout.flat
    )
    asked = ([layout.mask.sum()] if gather else []) + ([_kept_per_sequence(layout)] if own_sequence_ratio else [])
    numbers = sync.read_checks(checks, asked)  # the call's one host sync
    kept = None if weight is None else _kept_rows(layout.mask, numbers[0] if gather else None)
    needs_entropy = loss and (options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0)
    replay = replay_module.replay_of(
        transform,
        tensors.sampling_mask,
        replays=checked.replays,
        leading=layout.leading,
        mask=layout.mask,
        vocab=vocab,
        device=device,
        stats=checked.stats,
        full_entropy=loss and options.replay_entropy == "full",
        kept=kept,
    )
    memory_mode = (
        "fast"
        if replay is not None and kept is not None
        else _memory_mode(source, request, backend, checked.tile, shard, kept)
    )
    row_check = None
    if request.check_finite and not torch.compiler.is_compiling():  # compiled: unchecked rows give a NaN loss
        blame = {} if weight is None else {"source": finite.LINEAR_SOURCE, "causes": finite.LINEAR_CAUSES}
        index = None if kept is None else kept.index
        row_check = finite.RowCheck(**blame, flat=layout.flat, kept=index, zero_prob_ok=not loss)
    opts = PassOptions(
        backend=backend,
        temperature=transform.temperature,
        logit_scale=transform.logit_scale,
        final_logit_softcapping=transform.final_logit_softcapping,
        stats=replay_module.pass_stats(checked.stats, replay, loss, row_check is not None),
        replay=replay,
        inplace=request.inplace,
        chunk_size=_chunk_rows(source, request, shard, kept, replay is not None),
        memory=memory_mode,
        tile=checked.tile,
        head_precision=request.head_precision,
        with_entropy=request.with_entropy or needs_entropy,
        row_check=row_check,
    )
    route, old_pass = Route.LOGPROBS, False
    if loss:
        route = choose_route(source, inputs, request, options, memory=memory_mode, backend=backend)
        route = Route.TWO_PHASE if route is Route.FUSED_EPILOGUE and replay is not None else route  # epilogue: V
        if route is Route.LINEAR_TOKEN_LOSS:
            opts, old_pass = _own_ratio_chunks(inputs, kept, opts, numbers[1] if own_sequence_ratio else None)
    return Plan(
        route=route,
        source=source,
        layout=layout,
        kept=kept,
        shard=shard,
        pass_options=opts,
        options=options,
        inputs=inputs,
        return_sequence_losses=request.return_sequence_losses,
        return_logprobs=request.return_logprobs,
        old_pass=old_pass,
        stats=checked.stats,
    )


def _named(record: type, arguments: dict[str, Any]):
    """`record` with each field taken from the argument of the same name (absent ones keep their defaults)."""
    return record(**{name: arguments[name] for name in record.__dataclass_fields__ if name in arguments})


def _kept_rows(mask: Tensor, count: int | None) -> KeptRows:
    """`count` kept rows of `mask` [R, C], gathered with no further sync; None: every row, masked."""
    if count is None:
        index = torch.arange(mask.numel(), device=mask.device)  # [R·C]
        return KeptRows((index // mask.shape[1], index % mask.shape[1]), mask.reshape(-1))
    try:
        index = torch.nonzero_static(mask, size=count)  # [M, 2]: the count is known, so no sync
    except NotImplementedError:  # older torch on CUDA
        index = mask.nonzero()
    return KeptRows((index[:, 0], index[:, 1]), None)


def choose_route(
    source: Source, inputs: LossInputs, request: Request, options: LossOptions, *, memory: str, backend: str
) -> Route:
    """The one place a loss call's route is chosen. A token-level loss (`losses/epilogue.py`) whose weights take no
    gradient and whose statistics need no merging across ranks is formed inside the pass: in the fused lm_head's
    forward ("fast" memory, when a gradient is taken: without one its backward half would be waste), or in the
    forward kernel's epilogue where the backend has one that computes it (padded logits; on torch only when a
    gradient is taken); with a sampler correction of the pass's own log-probs (`LossInputs.ratio_reads_pass`), only
    in the fused lm_head's forward. Everything else, and every call asking for the per-sequence losses, runs
    two-phase."""
    weights = (inputs.token_weights, inputs.sequence_weights)
    if (
        (inputs.ratio_reads_pass and source.weight is None)
        or request.return_sequence_losses
        or not epilogue.is_token_level(options)
        or any(w is not None and w.requires_grad for w in weights)
        or request.process_group is not None  # a vocabulary shard: statistics merged across ranks
        or request.sequence_group is not None
    ):
        return Route.TWO_PHASE
    if source.weight is not None:
        return Route.LINEAR_TOKEN_LOSS if memory == "fast" and source.takes_grad else Route.TWO_PHASE
    caps = CAPABILITIES[backend]
    if (
        caps.epilogue_module
        and (source.takes_grad or not caps.epilogue_needs_grad)
        and not inputs.layout.flat
        and epilogue.fits_kernel_epilogue(options, caps.epilogue_kl)
    ):
        return Route.FUSED_EPILOGUE
    return Route.TWO_PHASE


def _own_ratio_chunks(
    inputs: LossInputs, kept: KeptRows, opts: PassOptions, rows_per_sequence: list[int] | None
) -> tuple[PassOptions, bool]:
    """The fused lm_head's 3-GEMM loss: its pass options, and whether a no-grad pass gives π_old first
    (`Plan.old_pass`, 1 GEMM more). A per-sequence sampler correction of the pass's own log-probs needs all of a
    sequence's tokens before its ratio: where the kept rows take more than one chunk, the chunks end at sequence
    boundaries (`sequence_chunks`: `rows_per_sequence`, the kept rows of each sequence in order; each chunk at most
    `opts.chunk_size` rows) and each forms its sequences' ratios from its own log-probs, after its logits GEMM and
    before its gradient GEMMs. One chunk does so as it is.

    A sequence longer than the chunk budget keeps the budget and the no-grad pass for that call (the log-probs a
    separate π_old pass gives, bitwise): a chunk grown to hold it would need [its rows, V] logits beyond the rows
    the engine chose (`memory.chunk_rows`: from free memory on CUDA), and long sequences are where the fused head's
    bounded memory matters. So too where the kept rows were not counted on the host (every row runs masked: a CUDA
    graph capture with the checks off, or torch.compile), and for packed rows (`cu_seqlens`): the trainer's
    padding-free micro-batches, whose two-pass twin (`--old-logprobs pass`) gives the same floats only on uniform
    chunks."""
    if not inputs.ratio_reads_pass or not inputs.sampler_correction.per_sequence:
        return opts, False
    if opts.chunk_size >= kept.index[0].shape[0]:
        return opts, False
    bounds = None if rows_per_sequence is None else sequence_chunks(rows_per_sequence, opts.chunk_size)
    if bounds is None:
        return opts, True
    return dataclasses.replace(opts, chunk_bounds=bounds), False


def sequence_chunks(rows_per_sequence: list[int], budget: int) -> tuple[int, ...] | None:
    """The row offsets (0, .., M) of chunks of whole sequences, whose rows come in order, `rows_per_sequence` each:
    each chunk takes the next sequences while they fit in `budget` rows. None when one sequence alone exceeds it."""
    bounds, start, stop = [0], 0, 0
    for rows in rows_per_sequence:
        if rows > budget:
            return None
        if stop + rows - start > budget:
            bounds.append(stop)
            start = stop
        stop += rows
    if stop > start:
        bounds.append(stop)
    return tuple(bounds)


def _kept_per_sequence(layout: Layout) -> Tensor:
    """The kept rows of each sequence of a padded [B, T] layout, [B], in the gathered rows' order."""
    return layout.mask.sum(1)


def _memory_mode(
    source: Source, request: Request, backend: str, tile: tuple[int, int] | None, shard, kept: KeptRows | None
) -> str:
    """The fused lm_head's memory mode, "fast" or "lean" (`memory.resolve_memory`); a vocabulary shard
    (`process_group`) runs "fast". Logits in: "fast" (unused)."""
    if kept is None:
        return "fast"
    if shard is not None:
        if request.memory == "lean" or tile is not None:
            raise ValueError("memory='lean' (and tile) do not run with process_group (a vocabulary shard)")
        return "fast"
    rows = kept.index[0].shape[0]
    return memory.resolve_memory(request.memory, backend, rows, source.weight, request.chunk_size, tile)


def _chunk_rows(source: Source, request: Request, shard, kept: KeptRows | None, replay: bool) -> int | None:
    """The fused lm_head's rows per chunk ("fast" memory: `memory.chunk_rows`), sized in the logits GEMM's dtype (a
    vocabulary shard's: the weight's). Logits in: the request's (unused)."""
    if kept is None:
        return request.chunk_size
    weight = source.weight
    dtype = weight.dtype if shard is not None else logits_dtype(request.head_precision, weight.dtype)
    rows = kept.index[0].shape[0]
    return memory.chunk_rows(rows, weight.shape[0], weight.shape[1], weight.device, request.chunk_size, dtype, replay)

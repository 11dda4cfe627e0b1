"""Plan: one call, decided once. Building it checks everything (the value checks inside one host sync), resolves the
backend and its capabilities, lays the rows out, cleans the targets, gathers the kept rows, sets the row-blame
policy and chooses the route; `routes.run` runs that route (`engine/routes.py`) and undoes the layout.

A public function is "build the plan, run it": `routes.run(build_plan(...))`, a loss call's plan with its
LossOptions; `Source` says whether logits or an lm_head feed the pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.engine import finite, memory, sync, validate
from grpo_kernels.engine import layout as layout_module
from grpo_kernels.engine import replay as replay_module
from grpo_kernels.engine.inputs import LossInputs, NamedRecord, TokenTensors
from grpo_kernels.engine.layout import KeptRows, Layout, safe_targets
from grpo_kernels.kernels import parallel
from grpo_kernels.kernels.backend import CAPABILITIES, resolve_backend
from grpo_kernels.kernels.head_precision import check_head_precision, logits_dtype
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
class Request(NamedRecord):
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
    temperature: float = 1.0
    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None
    head_precision: str = "auto"
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass(frozen=True)
class Plan:
    """Everything a call decided before any kernel runs."""

    route: Route
    source: Source
    layout: Layout
    rows: Tensor  # [R, C, V] logits or [R, C, H] hidden states: padded [B, T, ·]; packed or [N, ·] as [1, N, ·]
    targets: Tensor  # [R, C], checked (or, unchecked, ids outside [0, V) set to 0)
    mask: Tensor  # [R, C] bool
    invalid: Tensor | None  # [R, C] kept tokens whose unchecked target lay outside [0, V): their logp is NaN
    kept: KeptRows | None  # the rows the fused lm_head runs; None: logits in
    shard: parallel.VocabShard | None  # this rank's vocabulary shard (process_group)
    pass_options: PassOptions
    options: LossOptions | None = None  # a loss call's
    inputs: LossInputs | None = None  # a loss call's checked tensors
    return_sequence_losses: bool = False


def build_plan(*, source: Source, tensors: TokenTensors, request: Request, options: LossOptions | None = None) -> Plan:
    """The plan of a public call: a loss call (`options` given, `tensors` a `LossTensors`) or a log-prob call. It
    checks the source, builds the layout, reads every value check with one host sync, sets the pass's options and
    chooses the route."""
    loss = options is not None
    transform = options if loss else request  # where the logit transform comes from
    if not loss:  # a loss call's transform was checked with its LossOptions
        validate.check_temperature(request.temperature)
        validate.check_logit_transform(request.logit_scale, request.final_logit_softcapping)
    layout = Layout.of(source.name, source.x, tensors.cu_seqlens, flat_ok=not loss)
    rows = layout.rows(source.x)
    setup = _setup(source, rows, request)
    device = source.x.device
    inputs = None
    with sync.queued(request.check_finite) as reads:
        layout, targets, mask = layout.checked_tokens(tensors.targets, tensors.mask, setup.vocab, device)
        if loss:
            inputs = LossInputs.check(
                tensors,
                layout=layout,
                mask=mask,
                device=device,
                options=options,
                check_finite=request.check_finite,
                sequence_group=request.sequence_group,
            )
        gather = source.weight is not None and not setup.all_rows and not torch.compiler.is_compiling()
        if gather:  # compiled, every row runs masked: a count read on the host would break the graph
            reads.read(mask.sum())  # the fused lm_head's kept-row count sizes its gather
    sync.read_queued(reads)  # the call's one host sync
    targets, invalid = safe_targets(targets.long(), mask, setup.vocab, request.check_finite)
    kept = None
    if source.weight is not None:
        kept = KeptRows.of(mask, reads.numbers[0] if gather else None)
    needs_entropy = loss and (options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0)
    replay = replay_module.replay_of(
        transform,
        tensors.sampling_mask,
        rows=tuple(mask.shape),
        vocab=setup.vocab,
        device=device,
        stats=setup.stats,
        full_entropy=loss and options.replay_entropy == "full",
        kept=kept,
        memory=request.memory,
        tile=request.tile,
        sharded=setup.shard is not None,
    )
    memory_mode = "fast" if replay is not None and kept is not None else _memory_mode(source, request, setup, kept)
    opts = PassOptions(
        backend=setup.backend,
        temperature=transform.temperature,
        logit_scale=transform.logit_scale,
        final_logit_softcapping=transform.final_logit_softcapping,
        stats=replay_module.pass_stats(setup.stats, replay, loss),
        replay=replay,
        inplace=request.inplace,
        chunk_size=_chunk_rows(source, request, setup, kept, replay is not None),
        memory=memory_mode,
        tile=setup.tile,
        head_precision=request.head_precision,
        with_entropy=request.with_entropy or needs_entropy,
        row_check=finite.row_check(  # compiled: unchecked rows give a NaN loss; a second host read would break
            request.check_finite and not torch.compiler.is_compiling(),
            linear=source.weight is not None,
            position=layout.position(None if kept is None else kept.index),
            loss=loss,
        ),
    )
    route = Route.LOGPROBS
    if loss:
        route = choose_route(source, inputs, request, options, memory=memory_mode, backend=setup.backend)
        route = Route.TWO_PHASE if route is Route.FUSED_EPILOGUE and replay is not None else route  # epilogue: V
    return Plan(
        route=route,
        source=source,
        layout=layout,
        rows=rows,
        targets=targets,
        mask=mask,
        invalid=invalid,
        kept=kept,
        shard=setup.shard,
        pass_options=opts,
        options=options,
        inputs=inputs,
        return_sequence_losses=request.return_sequence_losses,
    )


def choose_route(
    source: Source, inputs: LossInputs, request: Request, options: LossOptions, *, memory: str, backend: str
) -> Route:
    """The one place a loss call's route is chosen. A token-level loss (`losses/epilogue.py`) whose weights take no
    gradient and whose statistics need no merging across ranks is formed inside the pass: in the fused lm_head's
    forward ("fast" memory, when a gradient is taken: without one its backward half would be waste), or in the
    forward kernel's epilogue where the backend has one that computes it (padded logits; on torch only when a
    gradient is taken). Everything else, and every call asking for the per-sequence losses, runs two-phase."""
    weights = (inputs.token_weights, inputs.sequence_weights)
    if (
        request.return_sequence_losses
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


@dataclass(frozen=True)
class _Setup:
    """What a call settles before reading any value: its backend, lean tile, vocabulary shard and size, and
    whether the fused lm_head runs every row (inside a CUDA graph capture with the checks off)."""

    backend: str
    stats: tuple[str, ...]
    tile: tuple[int, int] | None
    shard: parallel.VocabShard | None
    vocab: int
    all_rows: bool


def _setup(source: Source, rows: Tensor, request: Request) -> _Setup:
    backend = resolve_backend(request.backend, source.x.device)
    stats = validate.check_stats(request.stats, backend)
    tile = _check_source(source, rows, backend, request)
    shard = parallel.vocab_shard(request.process_group, source.local_vocab, request.vocab_start, stats)
    return _Setup(
        backend=backend,
        stats=stats,
        tile=tile,
        shard=shard,
        vocab=source.local_vocab if shard is None else shard.vocab,
        all_rows=source.weight is not None and layout_module.all_rows(request.check_finite, source.x.device),
    )


def _check_source(source: Source, rows: Tensor, backend: str, request: Request) -> tuple[int, int] | None:
    """The logits, or the lm_head and its chunking options, against the backend; returns the lean tile."""
    if source.weight is None:
        validate.check_logits(rows, backend)
        return None
    validate.check_linear(rows, source.weight, source.bias, backend)
    check_head_precision(request.head_precision)
    validate.check_chunk_size(request.chunk_size)
    return validate.check_memory(request.memory, request.tile, request.chunk_size, backend)


def _memory_mode(source: Source, request: Request, setup: _Setup, kept: KeptRows | None) -> str:
    """The fused lm_head's memory mode, "fast" or "lean" (`memory.resolve_memory`); a vocabulary shard
    (`process_group`) runs "fast". Logits in: "fast" (unused)."""
    if kept is None:
        return "fast"
    if setup.shard is not None:
        if request.memory == "lean" or setup.tile is not None:
            raise ValueError("memory='lean' (and tile) do not run with process_group (a vocabulary shard)")
        return "fast"
    rows = kept.index[0].shape[0]
    return memory.resolve_memory(request.memory, setup.backend, rows, source.weight, request.chunk_size, setup.tile)


def _chunk_rows(source: Source, request: Request, setup: _Setup, kept: KeptRows | None, replay: bool) -> int | None:
    """The fused lm_head's rows per chunk ("fast" memory: `memory.chunk_rows`), sized in the logits GEMM's dtype (a
    vocabulary shard's: the weight's). Logits in: the request's (unused)."""
    if kept is None:
        return request.chunk_size
    weight = source.weight
    dtype = weight.dtype if setup.shard is not None else logits_dtype(request.head_precision, weight.dtype)
    rows = kept.index[0].shape[0]
    return memory.chunk_rows(rows, weight.shape[0], weight.shape[1], weight.device, request.chunk_size, dtype, replay)

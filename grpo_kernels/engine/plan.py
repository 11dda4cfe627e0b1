"""Plan: one call, decided once. Building it checks everything (the value checks inside one host sync), resolves the
backend and its capabilities, lays the rows out, cleans the targets, gathers the kept rows, sets the row-blame
policy and chooses the route; `Plan.run` runs that route (`engine/routes.py`) and undoes the layout.

A public function is "build the plan, run it": `loss_plan` for grpo_loss / fused_linear_grpo_loss, `logprobs_plan`
for token_logprobs / fused_linear_token_logprobs; `Source` says whether logits or an lm_head feed the pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.engine import finite, layout, routes, sync, validate
from grpo_kernels.engine.inputs import LossInputs, LossTensors, NamedRecord
from grpo_kernels.engine.layout import KeptRows
from grpo_kernels.kernels import parallel
from grpo_kernels.kernels.backend import CAPABILITIES, resolve_backend
from grpo_kernels.kernels.fused_linear_lean import resolve_memory
from grpo_kernels.kernels.head_precision import check_head_precision
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.losses import epilogue
from grpo_kernels.options import LossOptions


class Route(enum.Enum):
    """How a call runs (`routes.py` has one function each)."""

    LOGPROBS = "logprobs"  # the vocabulary pass alone
    TWO_PHASE = "two_phase"  # the pass, then the loss algebra on its log-probs
    FUSED_EPILOGUE = "fused_epilogue"  # logits in: a token-level loss formed in the forward kernel's epilogue
    LINEAR_TOKEN_LOSS = "linear_token_loss"  # fused lm_head: a token-level loss's gradients formed in forward


RUNS = {
    Route.LOGPROBS: routes.logprobs,
    Route.TWO_PHASE: routes.two_phase,
    Route.FUSED_EPILOGUE: routes.fused_epilogue,
    Route.LINEAR_TOKEN_LOSS: routes.linear_token_loss,
}


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


@dataclass(frozen=True)
class Plan:
    """Everything a call decided before any kernel runs."""

    route: Route
    source: Source
    rows: Tensor  # [R, C, V] logits or [R, C, H] hidden states: padded [B, T, ·]; packed or [N, ·] as [1, N, ·]
    targets: Tensor  # [R, C], checked (or, unchecked, ids outside [0, V) set to 0)
    mask: Tensor  # [R, C] bool
    invalid: Tensor | None  # [R, C] kept tokens whose unchecked target lay outside [0, V): their logp is NaN
    kept: KeptRows | None  # the rows the fused lm_head runs; None: logits in
    shard: parallel.VocabShard | None  # this rank's vocabulary shard (process_group)
    pass_options: PassOptions
    options: LossOptions | None = None  # a loss call's
    inputs: LossInputs | None = None  # a loss call's checked tensors
    squeeze: bool = False  # [N, ·] log-prob inputs: [N] out
    return_sequence_losses: bool = False

    def run(self):
        return RUNS[self.route](self)


def loss_plan(source: Source, given: LossTensors, request: Request, options: LossOptions) -> Plan:
    """The plan of grpo_loss (logits) or fused_linear_grpo_loss (an lm_head)."""
    checks.check_tensor(source.name, source.x)
    setup = _setup(source, layout.layout_view(source.name, source.x, given.cu_seqlens), request)
    with sync.one_sync(request.check_finite) as reads:
        inputs = LossInputs.check(
            given,
            leading=tuple(source.x.shape[:-1]),
            vocab=setup.vocab,
            device=source.x.device,
            options=options,
            check_finite=request.check_finite,
            sequence_group=request.sequence_group,
        )
        _read_kept_count(source, inputs.mask, setup, reads)
    kept = _kept_rows(source, inputs.mask, setup, reads)
    flat = inputs.layout is not None
    with_entropy = request.with_entropy or options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0
    row_check = _row_check(source, request, flat, kept, loss=True)
    opts = _pass_options(
        source, request, setup, kept, transform=options, with_entropy=with_entropy, row_check=row_check
    )
    return Plan(
        route=choose_route(source, inputs, request, options, memory=opts.memory, backend=setup.backend),
        source=source,
        rows=source.x[None] if flat else source.x,
        targets=inputs.targets,
        mask=inputs.mask,
        invalid=inputs.invalid,
        kept=kept,
        shard=setup.shard,
        pass_options=opts,
        options=options,
        inputs=inputs,
        return_sequence_losses=request.return_sequence_losses,
    )


def logprobs_plan(source: Source, targets: Tensor, mask: Tensor | None, request: Request) -> Plan:
    """The plan of token_logprobs (logits) or fused_linear_token_logprobs (an lm_head)."""
    validate.check_temperature(request.temperature)
    validate.check_logit_transform(request.logit_scale, request.final_logit_softcapping)
    checks.check_tensor(source.name, source.x)
    squeeze = source.x.dim() == 2
    rows, targets, mask = layout.as_rows(source.x, targets, mask, name=source.name)
    setup = _setup(source, rows, request)
    with sync.one_sync(request.check_finite) as reads:
        mask = layout.checked_mask(mask, rows, targets, vocab=setup.vocab)
        _read_kept_count(source, mask, setup, reads)
    targets, invalid = layout.safe_targets(targets, mask, setup.vocab, request.check_finite)
    kept = _kept_rows(source, mask, setup, reads)
    row_check = _row_check(source, request, squeeze, kept, loss=False)
    opts = _pass_options(
        source, request, setup, kept, transform=request, with_entropy=request.with_entropy, row_check=row_check
    )
    return Plan(
        route=Route.LOGPROBS,
        source=source,
        rows=rows,
        targets=targets,
        mask=mask,
        invalid=invalid,
        kept=kept,
        shard=setup.shard,
        pass_options=opts,
        squeeze=squeeze,
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
        and inputs.layout is None
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
        all_rows=source.weight is not None and layout.all_rows(request.check_finite, source.x.device),
    )


def _pass_options(source: Source, request: Request, setup: _Setup, kept: KeptRows | None, **chosen) -> PassOptions:
    """The pass's options: the logit transform of `chosen["transform"]` (a loss call's LossOptions, a log-prob
    call's Request), the rest of `chosen` (with_entropy, row_check), the request's and the setup's."""
    transform = chosen.pop("transform")
    return PassOptions(
        backend=setup.backend,
        temperature=transform.temperature,
        logit_scale=transform.logit_scale,
        final_logit_softcapping=transform.final_logit_softcapping,
        stats=setup.stats,
        inplace=request.inplace,
        chunk_size=request.chunk_size,
        memory=_memory_mode(source, request, setup, kept),
        tile=setup.tile,
        head_precision=request.head_precision,
        **chosen,
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


def _read_kept_count(source: Source, mask: Tensor, setup: _Setup, reads: sync.ValueReads) -> None:
    """The fused lm_head's kept-row count sizes its gather: read with the checks' sync (inside `one_sync`)."""
    if source.weight is not None and not setup.all_rows:
        reads.read(mask.sum())


def _kept_rows(source: Source, mask: Tensor, setup: _Setup, reads: sync.ValueReads) -> KeptRows | None:
    if source.weight is None:
        return None
    return KeptRows.of(mask, None if setup.all_rows else reads.numbers[0])


def _row_check(source: Source, request: Request, flat: bool, kept: KeptRows | None, loss: bool):
    return finite.row_check(
        request.check_finite,
        linear=source.weight is not None,
        flat=flat,
        kept=None if kept is None else kept.index,
        loss=loss,
    )


def _memory_mode(source: Source, request: Request, setup: _Setup, kept: KeptRows | None) -> str:
    """The fused lm_head's memory mode, "fast" or "lean" (`fused_linear_lean.resolve_memory`); a vocabulary shard
    (`process_group`) runs "fast". Logits in: "fast" (unused)."""
    if kept is None:
        return "fast"
    if setup.shard is not None:
        if request.memory == "lean" or setup.tile is not None:
            raise ValueError("memory='lean' (and tile) do not run with process_group (a vocabulary shard)")
        return "fast"
    rows = kept.index[0].shape[0]
    return resolve_memory(request.memory, setup.backend, rows, source.weight, request.chunk_size, setup.tile)

"""Every check of a public call, in one place; each raises ValueError/TypeError naming the argument, what was
expected and what came, before any kernel runs.

First the arguments' types (`check_argument_types`, with the call's `locals()`: a TypeError before any shape, value
or kernel; the packed layout's `cu_seqlens` may be a list or tuple of ints, which becomes a tensor), then, in one
call from the plan (`check_call`), shapes, dtypes, devices and options (`mask must be [B, T] = [4, 128], got [4,
127]`). Checks of values (mask values, target range, normalisers) are O(N) device work returned as flags, which the
plan reads with the call's one host sync (`engine.sync.read_checks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.engine.finite import FINITE_AT_KEPT, nonfinite
from grpo_kernels.engine.memory import lean_backends
from grpo_kernels.engine.replay import SamplingMask
from grpo_kernels.engine.sync import ValueCheck
from grpo_kernels.kernels.backend import CAPABILITIES
from grpo_kernels.kernels.head_precision import check_head_precision
from grpo_kernels.kernels.protocol import TOKEN_STATS
from grpo_kernels.kernels.replay import REPLAY_STATS
from grpo_kernels.losses.sampler_ratio import SamplerCorrection
from grpo_kernels.option_checks import OPTION_RULES, check_option
from grpo_kernels.options import LossOptions
from grpo_kernels.shown import shown
from grpo_kernels.tensor_checks import raise_first


def _tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _ids(x: Any) -> bool:
    return isinstance(x, Tensor) and not x.is_floating_point() and not x.is_complex()


def _group(x: Any) -> bool:
    return dist.is_available() and isinstance(x, dist.ProcessGroup)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _names(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(name, str) for name in x)


# argument -> (test, what it must be, whether None is accepted)
_RULES: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    **dict.fromkeys(("logits", "hidden", "weight", "advantages"), (_tensor, "a torch.Tensor", False)),
    "targets": (_ids, "int64 or int32 token ids (a torch.Tensor)", False),
    **dict.fromkeys(
        ("old_logp", "ref_logp", "mask", "is_ratio", "sampling_logp", "token_weights", "sequence_weights", "bias"),
        (_tensor, "a torch.Tensor or None", True),
    ),
    **dict.fromkeys(
        ("with_entropy", "inplace", "check_finite", "return_sequence_losses", "return_logprobs"),
        (lambda x: isinstance(x, bool), "a bool", False),
    ),
    **dict.fromkeys(("backend", "memory"), (lambda x: isinstance(x, str), "a str", False)),
    "vocab_start": (_int, "an int or None", True),
    "stats": (_names, "a sequence of names", False),
    **dict.fromkeys(("process_group", "sequence_group"), (_group, "a torch.distributed.ProcessGroup or None", True)),
    "sampler_correction": (lambda x: isinstance(x, SamplerCorrection), "a SamplerCorrection or None", True),
}


def check_argument_types(args: Mapping[str, Any]) -> dict[str, Any]:
    """The types of a public function's arguments (its `locals()`), and the shared options' ranges (`option_checks`:
    the logit transform and the sampler's rule, each with one message wherever it comes in). Returns the arguments,
    `cu_seqlens` (a list or tuple of ints, or a tensor) as a tensor on the device of logits / hidden."""
    for name, value in args.items():
        if name in OPTION_RULES:
            check_option(name, value)
        if name not in _RULES:
            continue
        test, expected, optional = _RULES[name]
        if value is None and optional:
            continue
        if not test(value):
            got = f"{type(value).__name__} {shown(value)}" if not isinstance(value, Tensor) else f"{value.dtype} tensor"
            raise TypeError(f"{name} must be {expected}, got {got}")
    cu_seqlens = args.get("cu_seqlens")
    if cu_seqlens is None or isinstance(cu_seqlens, Tensor):
        return dict(args)
    if isinstance(cu_seqlens, (list, tuple)) and all(_int(v) for v in cu_seqlens):
        device = args.get("logits", args.get("hidden")).device
        return {**args, "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int64, device=device)}
    raise TypeError(
        f"cu_seqlens must be an integer torch.Tensor, a list or tuple of ints, or None, got {shown(cu_seqlens)}"
    )


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_logits(logits: Tensor, backend: str, *, flat: bool = False) -> None:
    """logits [B, T, V] (`flat`: [N, V]) with V >= 1, a dtype the backend computes in."""
    if logits.dim() != (2 if flat else 3) or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [B, T, V] with V >= 1, got {_shape(logits.shape)}")
    dtypes = CAPABILITIES[backend].dtypes
    if logits.dtype not in dtypes:
        raise TypeError(f"logits dtype must be one of {dtypes} for backend={backend!r}, got {logits.dtype}")


def check_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, backend: str, *, flat: bool = False) -> None:
    """hidden [B, T, H] (`flat`: [N, H]) and an lm_head weight [V, H] (bias [V]) of one float dtype, on one device."""
    if hidden.dim() != (2 if flat else 3):
        raise ValueError(f"hidden must be [B, T, H] (or packed [N, H]), got {_shape(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (2-D), got {_shape(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden {_shape(hidden.shape)} and weight {_shape(weight.shape)} disagree on H: hidden's last dimension "
            f"is {hidden.shape[-1]}, weight's second is {weight.shape[1]} (weight must be [V, H] with H = "
            f"{hidden.shape[-1]})"
        )
    dtypes = CAPABILITIES[backend].dtypes
    if hidden.dtype not in dtypes:
        raise TypeError(f"hidden dtype must be one of {dtypes} for backend={backend!r}, got {hidden.dtype}")
    for name, x in (("weight", weight), ("bias", bias)):
        if x is None:
            continue
        if x.dtype != hidden.dtype:
            raise TypeError(f"{name} dtype must match hidden's {hidden.dtype}, got {x.dtype}")
        if x.device != hidden.device:
            raise ValueError(f"{name} must be on {hidden.device} (the device of hidden), got {x.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {_shape(bias.shape)}")


def check_like(name: str, x: Tensor, shapes: tuple[tuple[int, ...], ...], labels: tuple[str, ...], device) -> None:
    """`x` (its type checked with the arguments') of one of `shapes`, on the device of logits."""
    if tuple(x.shape) not in shapes:
        expected = " or ".join(f"{label} = {_shape(s)}" for label, s in zip(labels, shapes, strict=True))
        raise ValueError(f"{name} must be {expected}, got {_shape(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of logits), got {x.device}")


def _check_float(name: str, x: Tensor | None, *expected: tuple[tuple[int, ...], str], device) -> None:
    """A float tensor of one of the `expected` (shape, label) pairs on the device of logits; None passes."""
    if x is None:
        return
    check_like(name, x, tuple(shape for shape, _ in expected), tuple(label for _, label in expected), device)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_cu_seqlens(cu_seqlens: Tensor, num_tokens: int) -> None:
    """int [S + 1], 0 first, N last, non-decreasing (its values read on the host: the packed layout sizes its
    padded view with them)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [S + 1] of cumulative sequence starts")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    starts = cu_seqlens.long()
    lengths = starts[1:] - starts[:-1]  # [S]
    if int(starts[0]) != 0 or int(starts[-1]) != num_tokens or bool((lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, end at N = {num_tokens} and never decrease, got {cu_seqlens.tolist()}"
        )


def check_tokens(
    targets: Tensor, mask: Tensor | None, token: tuple[tuple[int, ...], str], vocab: int, device, *, values: bool
) -> list[ValueCheck]:
    """Integer token ids and the mask (None: every token) of the `token` (shape, label) `[B, T]` or `[N]`, and with
    `values` their value checks, to be read with the call's one host sync: the mask bool or 0 / 1, the targets
    inside [0, V) wherever the mask keeps the token (padding is never read)."""
    shape, label = token
    if mask is not None:
        check_like("mask", mask, (shape,), (label,), device)
    check_like("targets", targets, (shape,), (label,), device)
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 or int32 token ids, got {targets.dtype}")
    if not values:
        return []
    checks = []
    if mask is not None and mask.dtype != torch.bool:
        checks.append((((mask != 0) & (mask != 1)).any(), _fail("mask must be bool or hold only 0 and 1")))
    keep = None if mask is None else mask.bool()
    outside = targets.clamp(0, vocab - 1) != targets  # [B, T]

    def fail() -> None:
        kept = targets if keep is None else targets[keep]
        lo, hi = int(kept.min()), int(kept.max())
        raise ValueError(f"targets must lie in [0, V) = [0, {vocab}) where mask is set, got values in [{lo}, {hi}]")

    checks.append(((outside if keep is None else outside & keep).any(), fail))
    return checks


def check_chunk_size(chunk_size: int | None) -> None:
    """The fused lm_head's rows per chunk: None (sized from memory) or a positive int."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def check_memory(memory: str, tile, chunk_size: int | None, backend: str) -> tuple[int, int] | None:
    """The fused lm_head's memory mode ("auto", "fast", "lean") and lean tile (rows, vocab) of positive ints or
    None; `tile` only with "lean"/"auto", `chunk_size` only with "fast"/"auto", "lean" only on torch and triton.
    Returns the tile as a tuple."""
    if memory not in ("auto", "fast", "lean"):
        raise ValueError(f"memory must be one of ('auto', 'fast', 'lean'), got {memory!r}")
    if tile is not None:
        if (
            not isinstance(tile, tuple | list)
            or len(tile) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in tile)
        ):
            raise ValueError(f"tile must be (rows, vocab), two positive ints, or None, got {tile!r}")
        if memory == "fast":
            raise ValueError(f"tile={tuple(tile)} sizes the tiles of memory='lean' (or 'auto'); got memory='fast'")
        tile = tuple(tile)
    if memory == "lean" and chunk_size is not None:
        raise ValueError(f"chunk_size={chunk_size} sizes the row chunks of memory='fast'; memory='lean' takes tile=")
    if memory == "lean" and backend not in lean_backends():
        raise ValueError(
            f"memory='lean' runs on backends {' and '.join(map(repr, lean_backends()))}, got backend={backend!r}"
        )
    return tile


def check_stats(stats: object, backend: str) -> tuple[str, ...]:
    """The requested extra statistics of the vocabulary pass, as a tuple of distinct known names (the replay
    statistics on every backend)."""
    names = (*TOKEN_STATS, *REPLAY_STATS)
    if isinstance(stats, str) or not all(isinstance(name, str) for name in stats):
        raise TypeError(f"stats must be a sequence of names from {names}, got {stats!r}")
    unknown = [name for name in stats if name not in names]
    if unknown:
        raise ValueError(f"stats must be names from {names}, got {unknown}")
    if any(name in TOKEN_STATS for name in stats) and not CAPABILITIES[backend].stats:
        stats_backends = tuple(name for name, caps in CAPABILITIES.items() if caps.stats)
        raise ValueError(f"stats are computed by the {stats_backends} backends, not backend={backend!r}")
    return tuple(dict.fromkeys(stats))


def check_side_inputs(given, *, token: tuple, sequence: tuple, device, options: LossOptions) -> None:
    """A loss call's tensors besides targets and mask (`inputs.LossTensors`), each per token (`token`: the layout's
    shape and its label, `[B, T]` or `[N]`) or per sequence (`[B]` or `[S]`); the normaliser option; ref_logp when
    the KL term needs it."""
    _check_float("advantages", given.advantages, token, sequence, device=device)
    for name in ("old_logp", "ref_logp", "sampling_logp"):
        _check_float(name, getattr(given, name), token, device=device)
    _check_float("is_ratio", given.is_ratio, token, sequence, device=device)
    _check_float("token_weights", given.token_weights, token, device=device)
    _check_float("sequence_weights", given.sequence_weights, sequence, device=device)
    items = options.num_items_in_batch
    if isinstance(items, Tensor) and items.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a number or a 1-element tensor, got {_shape(items.shape)}")
    if options.beta != 0.0 and given.ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={options.beta})")
    if options.rollout_correction is not None:
        check_correction_inputs(given, options.rollout_correction)
    if given.sampler_correction is not None:
        check_sampler_correction_inputs(given, options)


def check_sampler_correction_inputs(given, options: LossOptions) -> None:
    """`sampler_correction` forms the IS weight from π_old (old_logp, or the pass's own log-probs) and the sampler's
    log-probs: it needs sampling_logp, and takes no is_ratio and no rollout_correction beside it."""
    if given.sampling_logp is None:
        raise ValueError("sampler_correction needs sampling_logp (the sampler's log-probs), got None")
    if given.is_ratio is not None:
        raise ValueError("sampler_correction forms the IS weight: pass is_ratio=None, got a tensor")
    if options.rollout_correction is not None:
        raise ValueError("sampler_correction and rollout_correction are two sampler corrections: pass one of them")


def check_correction_inputs(given, correction) -> None:
    """`rollout_correction` needs the sampler's log-probs, forms the IS weight itself, and takes π_old from the
    sampler under bypass (old_logp None) or from old_logp otherwise."""
    if given.sampling_logp is None:
        raise ValueError("rollout_correction needs sampling_logp (the sampler's log-probs), got None")
    if given.is_ratio is not None:
        raise ValueError("rollout_correction forms the IS weight: pass is_ratio=None, got a tensor")
    if correction.bypass_mode and given.old_logp is not None:
        raise ValueError("rollout_correction.bypass_mode takes old_logp from sampling_logp: pass old_logp=None")
    if not correction.bypass_mode and given.old_logp is None:
        raise ValueError("rollout_correction (decoupled: bypass_mode=False) needs old_logp (π_old), got None")


def _fail(message: str) -> Callable[[], None]:
    def fail() -> None:
        raise ValueError(message)

    return fail


def check_normalisers(options: LossOptions, *, values: bool) -> list[ValueCheck]:
    """The normalisers given as numbers are finite; given as tensors, with `values`, their value checks (finite and
    > 0), to be read with the call's one host sync."""
    checks = []
    for name in ("num_items_in_batch", "num_sequences_in_batch"):
        value = getattr(options, name, None)
        if isinstance(value, Tensor):
            if values:
                flat = value.reshape(-1)
                bad = nonfinite(flat)
                checks.append((bad.any(), lambda name=name, x=flat, bad=bad: raise_first(name, x, bad, FINITE_AT_KEPT)))
                positive = lambda name=name, x=flat: _fail(f"{name} must be > 0, got {x[0].item()}")()  # noqa: E731
                checks.append((~(value > 0).all(), positive))
        elif value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    return checks


def check_replay(
    rule,
    sampling_mask: Any,
    stats: tuple[str, ...],
    *,
    leading: tuple[int, ...],
    vocab: int,
    linear: bool,
    request,
    full_entropy: bool,
) -> bool:
    """The sampler's rule (top_k, top_p, min_p: the Request or the LossOptions) or kept-token mask against the rest
    of the call, before any kernel runs: not both; the mask itself (`check_sampling_mask`, for targets of shape
    `leading`); not with memory="lean" (or a tile) on the fused lm_head (`linear`); not with the whole vocabulary's
    statistics; on vocabulary shards (`request.process_group`) top_p within top-k's candidates, and the whole
    entropy only with logits in. Values range-checked by the options. Returns whether the call replays a truncated
    sampler."""
    if sampling_mask is not None and (rule.top_k != 0 or rule.top_p != 1.0 or rule.min_p != 0.0):
        raise ValueError(
            "sampling_mask gives the kept tokens itself: pass it or the rule options (top_k, top_p, min_p), not both; "
            f"got top_k={rule.top_k}, top_p={rule.top_p}, min_p={rule.min_p}"
        )
    if sampling_mask is not None:
        check_sampling_mask(sampling_mask, leading, vocab)
    replays = 0 < rule.top_k < vocab or rule.top_p < 1.0 or rule.min_p > 0.0 or sampling_mask is not None
    if not replays:
        return False
    if linear and (request.memory == "lean" or request.tile is not None):
        raise ValueError(
            "memory='lean' (and tile) cannot replay a truncated sampler: its 2-D tiles never hold a row's logits "
            "whole, and the support's threshold needs the row; use memory='fast' or 'auto' (which picks it)"
        )
    full_stats = [name for name in stats if name not in REPLAY_STATS]
    if full_stats:
        raise ValueError(
            f"stats {full_stats} describe the whole vocabulary's distribution and do not replay a truncated sampler; "
            f"with top_k, top_p, min_p or sampling_mask ask for {REPLAY_STATS}"
        )
    if request.process_group is not None:
        check_shard_rule(rule.top_k, rule.top_p, vocab)
        if full_entropy and linear:
            raise ValueError(
                "replay_entropy='full' does not run on the fused lm_head's vocabulary shards (process_group): use "
                "replay_entropy='support', or logits in"
            )
    return True


def check_sampling_mask(sampling_mask: Any, leading: tuple[int, ...], vocab: int) -> None:
    """The kept-token mask: a `SamplingMask` (CSR: 1-D integer token_ids inside [0, V), offsets of one entry per
    position and the end, from 0, never decreasing, to len(token_ids)) or a padded integer tensor of the targets'
    shape `leading` (or flattened) then K, ids inside [0, V) or -1; its values on the device (not meta). The ids
    are read on the host: replay reads them anyway to pad them. Whether a kept position has an id is checked when
    the pass's mask is known (`replay.kept_ids`)."""
    if isinstance(sampling_mask, SamplingMask):
        _check_csr(sampling_mask, math.prod(leading), vocab)
        return
    if not isinstance(sampling_mask, Tensor) or sampling_mask.is_floating_point() or sampling_mask.dtype == torch.bool:
        raise TypeError(
            "sampling_mask must be a grpo_kernels.SamplingMask or an integer tensor [B, T, K] / [N, K] with -1 "
            f"padding, got {type(sampling_mask).__name__}"
            + (f" of {sampling_mask.dtype}" if isinstance(sampling_mask, Tensor) else "")
        )
    _check_readable("sampling_mask", sampling_mask)
    positions = math.prod(leading)
    flattened = sampling_mask.dim() == 2 and sampling_mask.shape[0] == positions
    if tuple(sampling_mask.shape[:-1]) != leading and not flattened:
        expected = f"[N, K] = [{positions}, K]"
        if len(leading) == 2:
            expected = f"[B, T, K] = [{leading[0]}, {leading[1]}, K] (or flattened: {expected.replace('N', 'B·T')})"
        raise ValueError(
            f"sampling_mask must be {expected}: the targets' shape, then the kept ids; got {list(sampling_mask.shape)}"
        )
    ids = sampling_mask.long()
    if bool(((ids < -1) | (ids >= vocab)).any()):
        raise ValueError(f"sampling_mask ids must lie in [0, V) = [0, {vocab}), with -1 as padding")


def _check_csr(mask: SamplingMask, positions: int, vocab: int) -> None:
    """`check_sampling_mask` of the CSR form, for `positions` target positions."""
    ids, offsets = mask.token_ids, mask.offsets
    for name, x in (("token_ids", ids), ("offsets", offsets)):
        if not isinstance(x, Tensor) or x.dim() != 1 or x.is_floating_point() or x.dtype == torch.bool:
            got = f"{x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"sampling_mask.{name} must be a 1-D integer tensor, got {got}")
        _check_readable(f"sampling_mask.{name}", x)
    if offsets.shape[0] != positions + 1:
        raise ValueError(
            f"sampling_mask.offsets must have positions + 1 = {positions + 1} entries (one per target position, "
            f"and the end), got {offsets.shape[0]}"
        )
    offsets = offsets.long().to(ids.device)
    if bool((offsets[0] != 0) | (offsets[-1] != ids.shape[0]) | (offsets.diff() < 0).any()):
        raise ValueError(
            f"sampling_mask.offsets must start at 0, never decrease and end at len(token_ids) = {ids.shape[0]}"
        )
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"sampling_mask.token_ids must lie in [0, V) = [0, {vocab})")


def _check_readable(name: str, x: Tensor) -> None:
    """A ValueError naming `name` for a tensor on the meta device: it has no values to read."""
    if x.device.type == "meta":
        raise ValueError(f"{name} must hold values, got a tensor on the meta device of shape {list(x.shape)}")


SHARD_TOP_K = 1024  # top_p on vocabulary shards: the largest top_k whose candidates the shards all-gather


def check_shard_rule(top_k: int, top_p: float, vocab: int) -> None:
    """top_p on vocabulary shards walks the merged candidates of top-k: it needs 1 <= top_k <= SHARD_TOP_K (each
    rank sends R·top_k floats per row; prime-rl bounds it at 512)."""
    if top_p < 1.0 and not 0 < top_k <= min(SHARD_TOP_K, vocab - 1):
        raise ValueError(
            f"top_p={top_p} on vocabulary shards (process_group) needs top_k in [1, {SHARD_TOP_K}]: the shards merge "
            f"their top-k candidates and top-p walks them; got top_k={top_k}"
        )


@dataclass(frozen=True)
class Checked:
    """What a call's checks settled: its statistics' names, the lean tile, and the value checks its one host sync
    reads (none with `check_finite=False`)."""

    stats: tuple[str, ...]
    tile: tuple[int, int] | None
    checks: tuple[ValueCheck, ...]
    replays: bool = False  # a truncated sampler's support (`check_replay`)


def check_call(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    tensors,
    request,
    *,
    options: LossOptions | None,
    backend: str,
    vocab: int,
) -> Checked:
    """Every check of a call after its arguments' types and options' ranges: logits `x` (or hidden states `x` through
    the lm_head `weight` and `bias`) and their layout, the statistics and the chunking options against `backend`, the
    targets and mask (`inputs.TokenTensors`) against a vocabulary of `vocab` ids, and a loss call's other tensors
    (`inputs.LossTensors`) and normalisers. The checks of values are returned to be read with one host sync."""
    loss = options is not None
    name, cu_seqlens = ("logits" if weight is None else "hidden"), tensors.cu_seqlens
    if cu_seqlens is not None and x.dim() != 2:
        raise ValueError(f"with cu_seqlens, {name} must be packed [N, ·], got {_shape(x.shape)}")
    if not loss and x.dim() not in (2, 3):
        raise ValueError(f"{name} must be [B, T, ·] or [N, ·], got {_shape(x.shape)}")
    flat = cu_seqlens is not None or (not loss and x.dim() == 2)
    stats = check_stats(request.stats, backend)
    tile = None
    if weight is None:
        check_logits(x, backend, flat=flat)
    else:
        check_linear(x, weight, bias, backend, flat=flat)
        check_head_precision(request.head_precision)
        check_chunk_size(request.chunk_size)
        tile = check_memory(request.memory, request.tile, request.chunk_size, backend)
    token = (tuple(x.shape[:1]), "[N]") if flat else (tuple(x.shape[:2]), "[B, T]")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.shape[0])
    values = request.check_finite
    checks = check_tokens(tensors.targets, tensors.mask, token, vocab, x.device, values=values)
    if loss:
        sequence = ((cu_seqlens.numel() - 1,), "[S]") if flat else ((x.shape[0],), "[B]")
        check_side_inputs(tensors, token=token, sequence=sequence, device=x.device, options=options)
        if options.rollout_correction is not None and request.sequence_group is not None:
            raise ValueError("rollout_correction does not run with sequence_group (its sequence statistics are local)")
        correction = tensors.sampler_correction
        if correction is not None and correction.per_sequence and request.sequence_group is not None:
            raise ValueError(f"sampler_correction mode {correction.mode!r} does not run with sequence_group (its "
                             "per-sequence ratio would be each rank's share); use a token mode")  # fmt: skip
        checks += check_normalisers(options, values=values)
    full_entropy = loss and options.replay_entropy == "full"
    rule = options if loss else request  # where the sampler's rule comes from
    replays = check_replay(
        rule,
        tensors.sampling_mask,
        stats,
        leading=token[0],
        vocab=vocab,
        linear=weight is not None,
        request=request,
        full_entropy=full_entropy,
    )
    return Checked(stats=stats, tile=tile, checks=tuple(checks), replays=replays)

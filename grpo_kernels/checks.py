"""Every input check; each raises ValueError/TypeError naming the argument, what was expected and what came.

The loss functions' checks run before any kernel: `mask must be [B, T] = [4, 128], got [4, 127]`; only the
finiteness of the logits is checked after the vocabulary pass, from its O(N) statistics (`check_row_stats`).
Checks of values (mask values, target range, non-finite inputs) are O(N) device work; inside `one_sync` they are
read with one host sync for all of them, or skipped (`enabled=False`), else each reads its own flag.
The per-sequence building blocks (advantages, rewards, sampling, regularizers) share the second half: there
`shape` holds the expected sizes, None where any size will do (`entropy must be [B, T] = [3, T], got [3]`);
`shape=None` asks for any non-empty tensor with the named `dims`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo_kernels.options import LossOptions

LOGITS_DTYPES = {
    "torch": (torch.bfloat16, torch.float16, torch.float32, torch.float64),
    "triton": (torch.bfloat16, torch.float16, torch.float32),
    "cuda": (torch.bfloat16, torch.float16, torch.float32),
}


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_logits(logits: Tensor, backend: str) -> None:
    """logits [B, T, V] with V >= 1, a dtype the backend computes in."""
    check_tensor("logits", logits)
    if logits.dim() != 3 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [B, T, V] with V >= 1, got {_shape(logits.shape)}")
    dtypes = LOGITS_DTYPES[backend]
    if logits.dtype not in dtypes:
        raise TypeError(f"logits dtype must be one of {dtypes} for backend={backend!r}, got {logits.dtype}")


def check_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, backend: str) -> None:
    """hidden [B, T, H] and an lm_head weight [V, H] (bias [V]) of one float dtype, on one device."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H] (or packed [N, H]), got {_shape(hidden.shape)}")
    check_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (2-D), got {_shape(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden {_shape(hidden.shape)} and weight {_shape(weight.shape)} disagree on H: hidden's last dimension "
            f"is {hidden.shape[-1]}, weight's second is {weight.shape[1]} (weight must be [V, H] with H = "
            f"{hidden.shape[-1]})"
        )
    dtypes = LOGITS_DTYPES[backend]
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


def _check_like(name: str, x: Tensor, shapes: tuple[tuple[int, ...], ...], labels: tuple[str, ...], device) -> None:
    check_tensor(name, x)
    if tuple(x.shape) not in shapes:
        expected = " or ".join(f"{label} = {_shape(s)}" for label, s in zip(labels, shapes, strict=True))
        raise ValueError(f"{name} must be {expected}, got {_shape(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of logits), got {x.device}")


def check_per_token_float(name: str, x: Tensor | None, B: int, T: int, device, per_sequence: bool = False) -> None:
    """A float tensor [B, T] (or [B] when `per_sequence`) on the device of logits; None passes."""
    if x is None:
        return
    shapes, labels = ((B, T), (B,)), ("[B, T]", "[B]")
    n = 2 if per_sequence else 1
    _check_like(name, x, shapes[:n], labels[:n], device)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_packed(name: str, x: Tensor | None, shapes, labels, device, floating: bool = True) -> None:
    """A packed-layout tensor of one of `shapes` on the device of logits (float unless told); None passes."""
    if x is None:
        return
    _check_like(name, x, shapes, labels, device)
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_per_sequence_float(name: str, x: Tensor | None, B: int, device) -> None:
    """A float tensor [B] on the device of logits; None passes."""
    if x is None:
        return
    _check_like(name, x, ((B,),), ("[B]",), device)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_mask(mask: Tensor, B: int, T: int, device) -> None:
    """A [B, T] bool tensor, or numbers that are all 0 or 1 (a value check: see `one_sync`)."""
    _check_like("mask", mask, ((B, T),), ("[B, T]",), device)
    if mask.dtype != torch.bool:
        _check_value(((mask != 0) & (mask != 1)).any(), _fail("mask must be bool or hold only 0 and 1"))


def check_targets(targets: Tensor, mask: Tensor, vocab: int, device) -> None:
    """Integer token ids [B, T], inside [0, V) wherever the mask keeps the token (padding is never read; the range
    is a value check: see `one_sync`)."""
    B, T = mask.shape
    _check_like("targets", targets, ((B, T),), ("[B, T]",), device)
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 or int32 token ids, got {targets.dtype}")
    outside = ((targets < 0) | (targets >= vocab)) & mask  # [B, T]

    def fail() -> None:
        kept = targets[mask]
        lo, hi = int(kept.min()), int(kept.max())
        raise ValueError(f"targets must lie in [0, V) = [0, {vocab}) where mask is set, got values in [{lo}, {hi}]")

    _check_value(outside.any(), fail)


def targets_in_vocab(targets: Tensor, mask: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """Unchecked targets made safe to index with, without a host sync: (targets with every id outside [0, V) set to
    0, the kept tokens that had one [B, T] bool), so that a kernel never reads outside a row and the caller can
    turn those tokens' results into NaN (`check_finite=False`)."""
    outside = (targets < 0) | (targets >= vocab)  # [B, T]
    return targets.masked_fill(outside, 0), outside & mask


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
    if memory == "lean" and backend not in ("torch", "triton"):
        raise ValueError(f"memory='lean' runs on backends 'torch' and 'triton', got backend={backend!r}")
    return tile


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def check_logit_transform(logit_scale: float, final_logit_softcapping: float | None) -> None:
    if not logit_scale > 0:
        raise ValueError(f"logit_scale must be > 0, got {logit_scale}")
    if final_logit_softcapping is not None and not final_logit_softcapping > 0:
        raise ValueError(f"final_logit_softcapping must be > 0 or None, got {final_logit_softcapping}")


def check_stats(stats: object, backend: str) -> tuple[str, ...]:
    """The requested extra statistics of the vocabulary pass, as a tuple of distinct known names."""
    from grpo_kernels.vocab.function import STATS_BACKENDS, TOKEN_STATS  # here: checks.py imports no vocab module

    if isinstance(stats, str) or not all(isinstance(name, str) for name in stats):
        raise TypeError(f"stats must be a sequence of names from {TOKEN_STATS}, got {stats!r}")
    unknown = [name for name in stats if name not in TOKEN_STATS]
    if unknown:
        raise ValueError(f"stats must be names from {TOKEN_STATS}, got {unknown}")
    if stats and backend not in STATS_BACKENDS:
        raise ValueError(f"stats are computed by the {STATS_BACKENDS} backends, not backend={backend!r}")
    return tuple(dict.fromkeys(stats))


def check_loss_inputs(
    B: int,
    T: int,
    device,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    options: LossOptions,
    sampling_logp: Tensor | None = None,
) -> None:
    """The loss's per-token and per-sequence inputs, and the options that need one of them."""
    check_tensor("advantages", advantages)
    check_per_token_float("advantages", advantages, B, T, device, per_sequence=True)
    check_per_token_float("old_logp", old_logp, B, T, device)
    check_per_token_float("ref_logp", ref_logp, B, T, device)
    check_per_token_float("sampling_logp", sampling_logp, B, T, device)
    check_per_token_float("is_ratio", is_ratio, B, T, device, per_sequence=True)
    if options.beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={options.beta})")
    items = options.num_items_in_batch
    if isinstance(items, Tensor) and items.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a number or a 1-element tensor, got {_shape(items.shape)}")


# Value checks, read together. A check of values queues a 0-dim bool flag (set: the check failed) and the function
# that raises its error; `one_sync` reads every flag queued inside it, and any count asked with `read`, with one
# host sync, then raises the first failure's error (the error path may sync again to name the bad value).
# Outside `one_sync` a check reads its own flag at once.


@dataclass
class ValueReads:
    """What one `one_sync` block reads: the queued checks and the asked numbers (`numbers`, after the block)."""

    enabled: bool
    checks: list[tuple[Tensor, Callable[[], None]]] = field(default_factory=list)
    asked: list[Tensor] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)

    def read(self, x: Tensor) -> None:
        """Read the 0-dim integer tensor `x` with the checks' sync, even when they are skipped; the value is in
        `numbers` (in the order asked) after the block."""
        self.asked.append(x)


_READS: contextvars.ContextVar[ValueReads | None] = contextvars.ContextVar("grpo_kernels_value_reads", default=None)


@contextlib.contextmanager
def one_sync(enabled: bool = True) -> Iterator[ValueReads]:
    """Queue the value checks made inside (mask values, target range, non-finite inputs) and read them, with the
    numbers asked by `ValueReads.read`, in one host sync on leaving, raising the first failed check's error.
    `enabled=False` skips the value checks (nothing is read unless a number was asked: no sync at all). An error
    raised inside (a shape or dtype check) leaves at once and reads nothing."""
    reads = ValueReads(enabled)
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)
    values = _read_once([flag for flag, _ in reads.checks] + reads.asked)
    for value, (_, fail) in zip(values, reads.checks, strict=False):
        if value:
            fail()
    reads.numbers = values[len(reads.checks) :]


def _read_once(xs: list[Tensor]) -> list[int]:
    """0-dim bool or integer tensors as ints: one device-to-host copy per device (CPU ones are read in place)."""
    out: list[int] = [0] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        by_device.setdefault(x.device, []).append(i)
    for indices in by_device.values():
        values = torch.stack([xs[i].reshape(()).to(torch.int64) for i in indices]).tolist()
        for i, value in zip(indices, values, strict=True):
            out[i] = value
    return out


def _check_value(bad: Tensor, fail: Callable[[], None]) -> None:
    """A value check: `bad` a 0-dim bool tensor (set: failed), `fail` raises its error."""
    reads = _READS.get()
    if reads is None:
        if bool(bad):
            fail()
    elif reads.enabled:
        reads.checks.append((bad, fail))


def check_positive_count(name: str, x: Tensor) -> None:
    """A normaliser given as a tensor (`num_items_in_batch`, `num_sequences_in_batch`) is > 0, as its Python value
    must be: a value check (see `one_sync`), so unchecked with `check_finite=False`."""

    def fail() -> None:
        raise ValueError(f"{name} must be > 0, got {x.reshape(-1)[0].item()}")

    _check_value(~(x > 0).all(), fail)


def _fail(message: str) -> Callable[[], None]:
    def fail() -> None:
        raise ValueError(message)

    return fail


# Non-finite values (`check_finite=True`). A kept token's values must be finite; padding may hold anything, NaN
# included, because it is never read. O(B·T) values, never a pass over [N, V].


def check_finite_at_kept(named: Sequence[tuple[str, Tensor | None, Tensor]]) -> None:
    """ValueError naming the first `(name, x, kept)` whose x holds NaN or ±inf where `kept` (bool, x's shape) is
    set, with the value and its index in x; None tensors pass. Value checks (see `one_sync`): one host sync for all
    of them, also when called alone."""
    with contextlib.ExitStack() as stack:
        if _READS.get() is None:
            stack.enter_context(one_sync())
        for name, x, kept in named:
            if x is not None:
                bad = ~torch.isfinite(x) & kept
                _check_value(bad.any(), lambda name=name, x=x, bad=bad: _raise_first(name, x, bad, FINITE_AT_KEPT))


FINITE_AT_KEPT = "be finite where the mask keeps a token"


LOGITS_CAUSES = "NaN or inf logits, or logits · logit_scale / temperature overflowing"


@dataclass(frozen=True)
class RowCheck:
    """How `check_row_stats` blames a bad row of the vocabulary pass: `source` (the logits' name) and `causes`;
    `position` turns a flat row index into the user's index (None: the index in the statistics' shape);
    `zero_prob_ok` lets a target of probability 0 (its logit −inf, so logp = −inf) pass."""

    source: str = "logits"
    causes: str = LOGITS_CAUSES
    position: Callable[[int], object] | None = None
    zero_prob_ok: bool = True


def check_row_stats(lse: Tensor, logp: Tensor, kept: Tensor | None, rows: RowCheck) -> None:
    """ValueError if a kept row's log-sum-exp is not finite or its target's logp is NaN (or −inf, unless
    `rows.zero_prob_ok`). lse, logp: the pass's O(N) statistics, any shape; kept: bool of that shape (None: all).
    One host sync."""
    bad = ~torch.isfinite(lse) | torch.isnan(logp)
    if not rows.zero_prob_ok:
        bad = bad | torch.isinf(logp)
    if kept is not None:
        bad = bad & kept
    if not bool(bad.any()):
        return
    flat = int(bad.reshape(-1).nonzero()[0])
    index, rest = [], flat
    for size in reversed(bad.shape):
        rest, i = divmod(rest, size)
        index.insert(0, i)
    where = rows.position(flat) if rows.position is not None else (index[0] if len(index) == 1 else tuple(index))
    row_lse, row_logp = lse.reshape(-1)[flat].item(), logp.reshape(-1)[flat].item()
    if math.isfinite(row_lse) and not math.isnan(row_logp):
        raise ValueError(
            f"{rows.source} give the target token probability 0 (logp = -inf: its logit is -inf) at index {where}, "
            "where the loss's ratio and log terms are undefined; mask that token, or pass check_finite=False to "
            "compute with logp = -inf (as TRL does)"
        )
    raise ValueError(
        f"{rows.source} must have a finite log-sum-exp at kept tokens, got {row_lse} (logp {row_logp}) at index "
        f"{where}: {rows.causes}"
    )


# Per-sequence building blocks: rewards, group ids, flags, texts.


def check_shape(name: str, x: object, shape: tuple[int | None, ...] | None = None, dims: str = "B") -> Tensor:
    """`x` if it is a tensor with the named `dims` ("B", "K", "B, T") and the sizes in `shape`."""
    check_tensor(name, x)
    names = dims.split(", ")
    if shape is None:
        if x.dim() != len(names) or x.numel() == 0:
            raise ValueError(f"{name} must be a non-empty [{dims}] tensor, got {list(x.shape)}")
    elif x.dim() != len(shape) or any(want not in (None, got) for want, got in zip(shape, x.shape, strict=False)):
        sizes = ", ".join(dim if want is None else str(want) for dim, want in zip(names, shape, strict=True))
        expected = f"[{dims}]" if sizes == dims else f"[{dims}] = [{sizes}]"
        raise ValueError(f"{name} must be {expected}, got {list(x.shape)}")
    return x


def _raise_first(name: str, x: Tensor, bad: Tensor, rule: str) -> None:
    """ValueError naming the first entry of `x` where `bad` holds, its value and its index, if there is one."""
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        where = index[0] if len(index) == 1 else index
        raise ValueError(f"{name} must {rule}, got {x[index].item()} at index {where}")


def check_finite(name: str, x: Tensor) -> None:
    """ValueError if `x` holds NaN or ±inf (mask padding out first if it may hold anything)."""
    _raise_first(name, x, ~torch.isfinite(x), "be finite")


def check_float(name: str, x: object, shape: tuple[int | None, ...] | None = None, dims: str = "B") -> Tensor:
    """`x`, a floating-point tensor of `shape`; its values are not checked (padding may hold anything)."""
    x = check_shape(name, x, shape, dims)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x


def checked_floats(
    name: str, x: object, shape: tuple[int | None, ...] | None = None, dims: str = "B", dtype: torch.dtype | None = None
) -> Tensor:
    """Finite real numbers (a tensor, which keeps its device, or a sequence) of `shape`, as a float tensor.

    In `dtype` when given; otherwise a floating-point `x` keeps its dtype and bools or integers become float64.
    """
    x = check_shape(name, x if isinstance(x, Tensor) else torch.as_tensor(x, dtype=dtype), shape, dims)
    if x.is_complex():
        raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
    x = x.to(dtype or (x.dtype if x.is_floating_point() else torch.float64))
    check_finite(name, x)
    return x


def checked_flags(name: str, x: object, shape: tuple[int | None, ...] | None = None, dims: str = "B") -> Tensor:
    """Flags (a bool tensor, numbers that are all 0 or 1, or a sequence of either) of `shape`, as a bool tensor."""
    x = check_shape(name, x if isinstance(x, Tensor) else torch.as_tensor(x), shape, dims)
    if x.dtype != torch.bool:
        if x.is_floating_point():
            check_finite(name, x)
        _raise_first(name, x, (x != 0) & (x != 1), "be bool or hold only 0 and 1")
    return x.bool()


def check_bool(name: str, x: object, shape: tuple[int | None, ...] | None = None, dims: str = "B") -> Tensor:
    """`x`, a bool tensor of `shape` (for inputs that must already be flags, not 0/1 numbers)."""
    x = check_shape(name, x, shape, dims)
    if x.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {x.dtype}")
    return x


def is_integer(x: Tensor) -> bool:
    """True for integer dtypes (bool excluded)."""
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def check_ids(name: str, ids: object, size: int) -> Tensor:
    """`ids`, an integer tensor [B] (group, prompt or stratum ids), B = `size`."""
    ids = check_shape(name, ids, (size,))
    if not is_integer(ids):
        raise TypeError(f"{name} must be an integer tensor, got {ids.dtype}")
    return ids


def check_rewards(rewards: Tensor, group_ids: Tensor, dims: str = "B") -> int:
    """Finite floating-point `rewards` [B] (or [B, K] with `dims="B, K"`) and integer `group_ids` [B]; returns B."""
    check_float("rewards", rewards, (None,) * len(dims.split(", ")), dims)
    batch = rewards.shape[0]
    check_ids("group_ids", group_ids, batch)
    check_finite("rewards", rewards)
    return batch


def check_length(name: str, values: Sequence | Tensor, size: int) -> None:
    """One entry per completion: len(values) == `size`."""
    if len(values) != size:
        raise ValueError(f"{name} must have one entry per completion ({size}), got {len(values)}")


def check_texts(name: str, texts: object) -> list[str]:
    """A list (or tuple) of strings, as a list."""
    if not isinstance(texts, (list, tuple)):
        raise TypeError(f"{name} must be a list of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")
    return list(texts)

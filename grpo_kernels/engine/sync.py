"""One host sync per call: the value checks queue 0-dim flags and `one_sync` reads them all at once."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

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


READS: contextvars.ContextVar[ValueReads | None] = contextvars.ContextVar("grpo_kernels_value_reads", default=None)
# Under torch.compile the open blocks live in this stack instead: the compiler traces one thread at a time and cannot
# trace a ContextVar (each use would break the graph).
_TRACED: list[ValueReads] = []


def open_reads() -> ValueReads | None:
    """The innermost open `one_sync` block's reads, or None outside every block."""
    if torch.compiler.is_compiling():
        return _TRACED[-1] if _TRACED else None
    return READS.get()


@contextlib.contextmanager
def one_sync(enabled: bool = True) -> Iterator[ValueReads]:
    """Queue the value checks made inside (mask values, target range, non-finite inputs) and read them, with the
    numbers asked by `ValueReads.read`, in one host sync on leaving, raising the first failed check's error.
    `enabled=False` skips the value checks (nothing is read unless a number was asked: no sync at all). An error
    raised inside (a shape or dtype check) leaves at once and reads nothing."""
    with queued(enabled) as reads:
        yield reads
    read_queued(reads)


@contextlib.contextmanager
def queued(enabled: bool = True) -> Iterator[ValueReads]:
    """`one_sync` without the read: the caller calls `read_queued` after the block. Under torch.compile the read,
    outside the block, is where the graph breaks (a break inside a block would stop the compiler from tracing it)."""
    reads = ValueReads(enabled)
    if torch.compiler.is_compiling():
        _TRACED.append(reads)
        try:
            yield reads
        finally:
            _TRACED.pop()
    else:
        token = READS.set(reads)
        try:
            yield reads
        finally:
            READS.reset(token)


def read_queued(reads: ValueReads) -> None:
    """Read a block's queued checks and asked numbers with one host sync; raise the first failed check's error."""
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
    for indices in by_device.values():  # stack promotes bool flags and integer counts to one dtype
        values = torch.stack([xs[i] if xs[i].dim() == 0 else xs[i].reshape(()) for i in indices]).tolist()
        for i, value in zip(indices, values, strict=True):
            out[i] = value
    return out


def check_value(bad: Tensor, fail: Callable[[], None]) -> None:
    """A value check: `bad` a 0-dim bool tensor (set: failed), `fail` raises its error."""
    reads = open_reads()
    if reads is None:
        if bool(bad):
            fail()
    elif reads.enabled:
        reads.checks.append((bad, fail))


def check_positive_count(name: str, x: Tensor) -> None:
    """A normaliser given as a tensor (`num_items_in_batch`, `num_sequences_in_batch`) is > 0, as its Python value
    must be: a value check, so unchecked with `check_finite=False`."""

    def fail() -> None:
        raise ValueError(f"{name} must be > 0, got {x.reshape(-1)[0].item()}")

    check_value(~(x > 0).all(), fail)


def fail_with(message: str) -> Callable[[], None]:
    def fail() -> None:
        raise ValueError(message)

    return fail

"""One host sync per call: the value checks are 0-dim flags, and `read_checks` reads them all at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# A check of values: a 0-dim bool flag (set: the check failed) and the function that raises its error (the error
# path may sync again to name the bad value).
ValueCheck = tuple[Tensor, Callable[[], None]]


def read_checks(checks: Sequence[ValueCheck], asked: Sequence[Tensor] = ()) -> list[int | list[int]]:
    """Read every check's flag and the integer tensors `asked` (0-dim: an int; 1-D: a list of ints) with one host
    sync; raise the first failed check's error, else return the asked numbers, in order. Nothing to read: no sync
    (so under torch.compile, no graph break)."""
    lists = frozenset(len(checks) + i for i, x in enumerate(asked) if x.dim() == 1)
    values = _read_once([flag for flag, _ in checks] + list(asked), lists)
    for value, (_, fail) in zip(values, checks, strict=False):
        if value:
            fail()
    return values[len(checks) :]


def _read_once(xs: list[Tensor], lists: frozenset[int] = frozenset()) -> list[int | list[int]]:
    """Bool or integer tensors as ints (0-dim, or read as their one value), those at the indices `lists` (1-D) as
    lists of ints: one device-to-host copy per device (CPU ones are read in place). Without lists: one stack, as
    few ops as the call's checks allow."""
    out: list[int | list[int]] = [0] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        by_device.setdefault(x.device, []).append(i)
    for indices in by_device.values():
        single = [i for i in indices if i not in lists]
        many = [i for i in indices if i in lists]
        parts = [torch.stack([xs[i] if xs[i].dim() == 0 else xs[i].reshape(()) for i in single])] if single else []
        values = (torch.cat(parts + [xs[i] for i in many]) if many else parts[0]).tolist()  # cat/stack promote
        for i, value in zip(single, values, strict=False):
            out[i] = value
        start = len(single)
        for i in many:
            out[i] = values[start : start + xs[i].numel()]
            start += xs[i].numel()
    return out

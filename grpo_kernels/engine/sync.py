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
    flags = [flag.reshape(()) for flag, _ in checks]
    values = _read_once(flags + list(asked))
    for value, (_, fail) in zip(values, checks, strict=False):
        if value:
            fail()
    return values[len(checks) :]


def _read_once(xs: list[Tensor]) -> list[int | list[int]]:
    """0-dim bool or integer tensors as ints, 1-D ones as lists of ints: one device-to-host copy per device (CPU ones
    are read in place)."""
    out: list[int | list[int]] = [0] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        by_device.setdefault(x.device, []).append(i)
    for indices in by_device.values():  # cat promotes bool flags and integer counts to one dtype
        values = torch.cat([xs[i].reshape(-1) for i in indices]).tolist()
        start = 0
        for i in indices:
            stop = start + xs[i].numel()
            out[i] = values[start] if xs[i].dim() == 0 else values[start:stop]
            start = stop
    return out

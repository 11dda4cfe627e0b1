"""The two checks every layer shares: a value is a tensor (`check_tensor`), and the first bad entry of a tensor named
with its value and index (`raise_first`). The building blocks' checks (`checks.py`) and the engine's (`engine/`) both
stand on these; this module imports nothing of the package."""

from __future__ import annotations

from torch import Tensor


def check_tensor(name: str, x: object) -> Tensor:
    """`x` if it is a torch.Tensor; a TypeError naming `name` and the type that came otherwise."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def raise_first(name: str, x: Tensor, bad: Tensor, rule: str) -> None:
    """ValueError naming the first entry of `x` where `bad` holds, its value and its index, if there is one."""
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        where = index[0] if len(index) == 1 else index
        raise ValueError(f"{name} must {rule}, got {x[index].item()} at index {where}")

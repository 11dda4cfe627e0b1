"""Input checks shared by the building blocks (advantages, rewards, sampling, regularizers, groups, tasks); each raises
ValueError/TypeError naming the argument, what was expected and what came. `shape` holds the expected sizes, None
where any size will do (`entropy must be [B, T] = [3, T], got [3]`); `shape=None` asks for any non-empty tensor with
the named `dims`. (The engine's checks of a loss call live in `engine/validate.py`; both stand on
`tensor_checks.py`.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_kernels.tensor_checks import check_tensor, raise_first


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


def check_finite(name: str, x: Tensor) -> None:
    """ValueError if `x` holds NaN or ±inf (mask padding out first if it may hold anything)."""
    raise_first(name, x, ~torch.isfinite(x), "be finite")


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
        raise_first(name, x, (x != 0) & (x != 1), "be bool or hold only 0 and 1")
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

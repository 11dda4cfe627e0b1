"""The public functions' argument types, checked first: a TypeError naming the argument, the expected and the
received type, before any shape, value or kernel. One function per entry point, called with the entry point's
`locals()`; the packed layout's `cu_seqlens` may be a list or tuple of ints, which comes back as a tensor.

Values (ranges) are checked later, where they are used (`checks`, `LossOptions`), as are `chunk_size` and `tile`,
whose checks there cover their types too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.shown import shown


def _tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _ids(x: Any) -> bool:
    return isinstance(x, Tensor) and not x.is_floating_point() and not x.is_complex()


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
    **dict.fromkeys(("temperature", "logit_scale"), (_number, "a float", False)),
    "final_logit_softcapping": (_number, "a float or None", True),
    **dict.fromkeys(
        ("with_entropy", "inplace", "check_finite", "return_sequence_losses"),
        (lambda x: isinstance(x, bool), "a bool", False),
    ),
    **dict.fromkeys(("backend", "memory"), (lambda x: isinstance(x, str), "a str", False)),
    "vocab_start": (_int, "an int or None", True),
    "stats": (_names, "a sequence of names", False),
    **dict.fromkeys(("process_group", "sequence_group"), (_group, "a torch.distributed.ProcessGroup or None", True)),
}


def _check(args: Mapping[str, Any]) -> None:
    for name, value in args.items():
        if name not in _RULES:
            continue
        test, expected, optional = _RULES[name]
        if value is None and optional:
            continue
        if not test(value):
            got = f"{type(value).__name__} {shown(value)}" if not isinstance(value, Tensor) else f"{value.dtype} tensor"
            raise TypeError(f"{name} must be {expected}, got {got}")
        if isinstance(value, float) and not math.isfinite(value):  # each float argument must be > 0
            raise ValueError(f"{name} must be > 0 and finite, got {value}")


def _cu_seqlens(value: Any, like: Tensor) -> Tensor | None:
    """`cu_seqlens` as a tensor on `like`'s device (a list or tuple of ints converted); a TypeError otherwise."""
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, (list, tuple)) and all(_int(v) for v in value):
        return torch.tensor(value, dtype=torch.int64, device=like.device)
    raise TypeError(f"cu_seqlens must be an integer torch.Tensor, a list or tuple of ints, or None, got {shown(value)}")


def token_logprobs(args: Mapping[str, Any]) -> None:
    """`api.token_logprobs`' arguments."""
    _check(args)


def fused_linear_token_logprobs(args: Mapping[str, Any]) -> None:
    """`api.fused_linear_token_logprobs`' arguments."""
    _check(args)


def grpo_loss(args: Mapping[str, Any]) -> Tensor | None:
    """`api.grpo_loss`' arguments; its `cu_seqlens` as a tensor (or None)."""
    _check(args)
    return _cu_seqlens(args["cu_seqlens"], args["logits"])


def fused_linear_grpo_loss(args: Mapping[str, Any]) -> Tensor | None:
    """`api.fused_linear_grpo_loss`' arguments; its `cu_seqlens` as a tensor (or None)."""
    _check(args)
    return _cu_seqlens(args["cu_seqlens"], args["hidden"])


def is_fused_call(x: Any, args: tuple) -> bool:
    """Whether `GRPOLoss()(x, *args)` is the fused form (hidden, weight [V, H], targets, ...): a floating-point 2-D
    second argument whose last dimension is x's. Anything else is the logits form, whose checks name the argument
    (float targets among them)."""
    weight = args[0] if args else None
    if not (isinstance(x, Tensor) and isinstance(weight, Tensor) and weight.is_floating_point()):
        return False
    return weight.dim() == 2 and weight.shape[-1] == x.shape[-1]

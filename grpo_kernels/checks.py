"""Every input check of the public functions; each raises ValueError/TypeError before any kernel runs."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.options import LossOptions

LOGITS_DTYPES = {
    "torch": (torch.bfloat16, torch.float16, torch.float32, torch.float64),
    "triton": (torch.bfloat16, torch.float16, torch.float32),
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
    """A [B, T] bool tensor, or numbers that are all 0 or 1."""
    _check_like("mask", mask, ((B, T),), ("[B, T]",), device)
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be bool or hold only 0 and 1")


def check_targets(targets: Tensor, mask: Tensor, vocab: int, device) -> None:
    """Integer token ids [B, T], inside [0, V) wherever the mask keeps the token (padding is never read)."""
    B, T = mask.shape
    _check_like("targets", targets, ((B, T),), ("[B, T]",), device)
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 or int32 token ids, got {targets.dtype}")
    kept = targets[mask]
    if kept.numel() and (kept.min() < 0 or kept.max() >= vocab):
        lo, hi = int(kept.min()), int(kept.max())
        raise ValueError(f"targets must lie in [0, V) = [0, {vocab}) where mask is set, got values in [{lo}, {hi}]")


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def check_loss_inputs(
    B: int,
    T: int,
    device,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    options: LossOptions,
) -> None:
    """The loss's per-token and per-sequence inputs, and the options that need one of them."""
    check_tensor("advantages", advantages)
    check_per_token_float("advantages", advantages, B, T, device, per_sequence=True)
    check_per_token_float("old_logp", old_logp, B, T, device)
    check_per_token_float("ref_logp", ref_logp, B, T, device)
    check_per_token_float("is_ratio", is_ratio, B, T, device, per_sequence=True)
    if options.beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={options.beta})")
    items = options.num_items_in_batch
    if isinstance(items, Tensor) and items.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a number or a 1-element tensor, got {_shape(items.shape)}")

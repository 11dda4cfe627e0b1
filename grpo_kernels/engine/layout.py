"""The rows a call runs: the layout's [R, C, ·] view (padded [B, T, ·], packed [N, ·] as [1, N, ·], or [N, ·]
log-prob inputs as one row), the mask and targets checked, and the kept rows the fused lm_head gathers and scatters
back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.engine import validate


def layout_view(name: str, x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """x as [R, C, ·] rows: itself when padded; packed [N, ·] (with cu_seqlens) as [1, N, ·]."""
    if cu_seqlens is None:
        return x
    if x.dim() != 2:
        raise ValueError(f"with cu_seqlens, {name} must be packed [N, ·], got {list(x.shape)}")
    return x[None]


def as_rows(x: Tensor, targets: Tensor, mask: Tensor | None, name: str = "logits"):
    """[N, ·] inputs as one row of N tokens: [1, N, ·], targets and mask [1, N]."""
    if x.dim() == 2:
        return x[None], checks.check_tensor("targets", targets)[None], None if mask is None else mask[None]
    if x.dim() != 3:
        raise ValueError(f"{name} must be [B, T, ·] or [N, ·], got {list(x.shape)}")
    return x, targets, mask


def checked_mask(mask: Tensor | None, rows: Tensor, targets: Tensor, vocab: int | None = None) -> Tensor:
    B, T = rows.shape[:2]
    mask = torch.ones((B, T), dtype=torch.bool, device=rows.device) if mask is None else mask
    validate.check_mask(mask, B, T, rows.device)
    validate.check_targets(targets, mask.bool(), rows.shape[-1] if vocab is None else vocab, rows.device)
    return mask.bool()


def safe_targets(targets: Tensor, mask: Tensor, vocab: int, check_finite: bool) -> tuple[Tensor, Tensor | None]:
    """Checked targets as they are; unchecked ones (`check_finite=False`) with ids outside [0, V) set to 0, and the
    kept tokens that had one, whose logp becomes NaN (`nan_at_invalid`): no host sync, no read outside a row."""
    if check_finite:
        return targets, None
    return validate.targets_in_vocab(targets, mask, vocab)


def nan_at_invalid(logp: Tensor, invalid: Tensor | None) -> Tensor:
    """logp, NaN at the kept tokens whose target was outside [0, V) (unchecked input)."""
    return logp if invalid is None else logp.masked_fill(invalid, float("nan"))


def all_rows(check_finite: bool, device: torch.device) -> bool:
    """Whether the fused lm_head runs every row, masked, instead of gathering the kept ones: only with the checks
    off inside a CUDA graph capture, where reading the kept-row count (one host sync, batched with the checks') is
    not allowed. Elsewhere that read costs less than the GEMMs on padding rows."""
    return not check_finite and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class KeptRows:
    """The rows the fused lm_head runs: `index` (r, c) into the [R, C] rows, in order; `row_mask` [M] None when
    only kept rows were gathered, else every row runs and it marks the kept ones."""

    index: tuple[Tensor, Tensor]
    row_mask: Tensor | None

    @classmethod
    def of(cls, mask: Tensor, count: int | None) -> KeptRows:
        """`count` kept rows of `mask` [R, C], gathered with no further sync; None: every row, masked."""
        if count is None:
            index = torch.arange(mask.numel(), device=mask.device)  # [R·C]
            return cls((index // mask.shape[1], index % mask.shape[1]), mask.reshape(-1))
        try:
            index = torch.nonzero_static(mask, size=count)  # [M, 2]: the count is known, so no sync
        except NotImplementedError:  # older torch on CUDA
            index = mask.nonzero()
        return cls((index[:, 0], index[:, 1]), None)

    def take(self, x: Tensor) -> Tensor:
        """x [R, C, ·] at the kept rows, [M, ·] (every row: a view, no gather)."""
        return x[self.index] if self.row_mask is None else x.flatten(0, 1)

    def scatter(self, values: Tensor | None, mask: Tensor) -> Tensor | None:
        """Kept-row values [M] back into rows [R, C] (0 elsewhere); differentiable."""
        if values is None:
            return None
        return values.new_zeros(mask.shape).index_put(self.index, values)

"""The rows a public function runs: the layout's [R, C, ·] view, the mask and targets checked, the kept rows the
fused lm_head gathers and scatters back, and the row check that names a bad row by the user's index."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.engine import finite, validate


def layout_view(name: str, x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """x as [R, C, ·] rows: itself when padded; packed [N, ·] (with cu_seqlens) as [1, N, ·]."""
    if cu_seqlens is None:
        return x
    if x.dim() != 2:
        raise ValueError(f"with cu_seqlens, {name} must be packed [N, ·], got {list(x.shape)}")
    return x[None]


def row_check(
    check_finite: bool,
    rows: finite.RowCheck,
    flat: bool,
    kept: tuple[Tensor, Tensor] | None = None,
    loss: bool = False,
) -> finite.RowCheck | None:
    """The vocabulary pass's row check (None: `check_finite=False`), naming a bad row by the user's index: (b, t),
    or n for `[N, ·]` inputs (`flat`), through `kept` when the pass saw only the kept rows. A loss refuses a
    target of probability 0 (logp = -inf)."""
    if not check_finite:
        return None
    if kept is not None:
        position = lambda i: int(kept[1][i]) if flat else (int(kept[0][i]), int(kept[1][i]))  # noqa: E731
    else:
        position = (lambda i: i) if flat else None
    return dataclasses.replace(rows, position=position, zero_prob_ok=not loss)


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
    kept tokens that had one, whose logp becomes NaN (`poison`): no host sync, no read outside a row."""
    if check_finite:
        return targets, None
    return validate.targets_in_vocab(targets, mask, vocab)


def poison(logp: Tensor, invalid: Tensor | None) -> Tensor:
    """logp, NaN at the kept tokens whose target was outside [0, V) (unchecked input)."""
    return logp if invalid is None else logp.masked_fill(invalid, float("nan"))


def all_rows(check_finite: bool, device: torch.device) -> bool:
    """Whether the fused lm_head runs every row, masked, instead of gathering the kept ones: only with the checks
    off inside a CUDA graph capture, where reading the kept-row count (one host sync, batched with the checks') is
    not allowed. Elsewhere that read costs less than the GEMMs on padding rows."""
    return not check_finite and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kept_index(mask: Tensor, count: int | None) -> tuple[tuple[Tensor, Tensor], Tensor | None]:
    """((r, c) indices of the rows the fused lm_head runs, in [R, C] order; the mask of those rows [M] or None when
    they are all kept). `count` kept rows are gathered with no further sync; None: every row, masked."""
    if count is None:
        index = torch.arange(mask.numel(), device=mask.device)  # [R·C]
        return (index // mask.shape[1], index % mask.shape[1]), mask.reshape(-1)
    try:
        index = torch.nonzero_static(mask, size=count)  # [M, 2]: the count is known, so no sync
    except NotImplementedError:  # older torch on CUDA
        index = mask.nonzero()
    return (index[:, 0], index[:, 1]), None


def take(x: Tensor, kept: tuple[Tensor, Tensor], row_mask: Tensor | None) -> Tensor:
    """x [R, C, ·] at the rows `kept_index` chose, [M, ·] (every row: a view, no gather)."""
    return x[kept] if row_mask is None else x.flatten(0, 1)


def scatter(values: Tensor | None, kept: tuple[Tensor, Tensor], mask: Tensor) -> Tensor | None:
    """Kept-token values [M] back into rows [R, C] (0 elsewhere); differentiable."""
    if values is None:
        return None
    return values.new_zeros(mask.shape).index_put(kept, values)

"""A call's layout: where its tokens sit, padded `[B, T, ·]`, flat `[N, ·]` (log-prob inputs) or packed `[N, ·]`
(`cu_seqlens`). The vocabulary pass sees each as `[R, C, ·]` rows (`[B, T, ·]`, or `[1, N, ·]`); the loss algebra sees
a padded `[B, T]` (packed: `[S, T_max]`) view. `lay_out` builds the `Layout` of a checked call once, a plain record:
the rows, the mask and targets as rows, the sequence count and which sequences keep a token, the index of each token
in the padded view, and the user's shape the results take back. Its readers use plain tensor ops on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Layout:
    """A checked call's tokens as the pass's rows and as the loss algebra's padded view."""

    leading: tuple[int, ...]  # the user's leading dims, (B, T) or (N,): the shape per-token results take back
    flat: bool  # [N, ·] inputs, one row [1, N, ·] of the pass
    rows: Tensor  # [R, C, V] logits or [R, C, H] hidden states
    mask: Tensor  # [R, C] bool
    targets: Tensor  # [R, C] int64; unchecked (`check_finite=False`): ids outside [0, V) set to 0
    invalid: Tensor | None  # [R, C] kept tokens whose unchecked target lay outside [0, V): their logp becomes NaN
    sequence_kept: Tensor | None  # [B] / [S] bool: the sequence has a kept token (loss calls)
    padded_index: tuple[Tensor, Tensor] | None  # packed: (sequence, position) of each token in [S, T_max]
    padded_shape: tuple[int, ...]  # the loss algebra's view, (sequences, length): (B, T), (S, T_max); flat (1, N)
    all_rows: bool  # the fused lm_head runs every row, masked (`all_rows`)


def lay_out(
    x: Tensor,
    targets: Tensor,
    mask: Tensor | None,
    cu_seqlens: Tensor | None,
    *,
    vocab: int,
    check_finite: bool,
    loss: bool,
    linear: bool,
) -> Layout:
    """The layout of a call whose arguments passed `validate.check_call`: logits or hidden states `x` (packed
    `[N, ·]` with `cu_seqlens`, else `[B, T, ·]` or, a log-prob call's, `[N, ·]`), targets and mask (None: every
    token) of its leading shape, a vocabulary of `vocab` ids."""
    flat = cu_seqlens is not None or x.dim() == 2
    leading = tuple(x.shape[:-1])
    mask = torch.ones(leading, dtype=torch.bool, device=x.device) if mask is None else mask.bool()
    rows, mask, targets = (x[None], mask[None], targets[None]) if flat else (x, mask, targets)
    targets, invalid = _safe_targets(targets.long(), mask, vocab, check_finite)
    kept, index, padded_shape = None, None, mask.shape
    if cu_seqlens is not None:
        starts = cu_seqlens.to(x.device).long()
        lengths = starts[1:] - starts[:-1]  # [S]
        num_sequences = lengths.numel()
        sequence = torch.repeat_interleave(torch.arange(num_sequences, device=x.device), lengths)  # [N]
        index = (sequence, torch.arange(leading[0], device=x.device) - starts[sequence])  # [N] each
        padded_shape = (num_sequences, int(lengths.max()) if leading[0] else 0)
        if loss:
            kept = torch.zeros(num_sequences, dtype=torch.bool, device=x.device).index_fill_(0, sequence[mask[0]], True)
    elif loss:
        kept = mask.any(1)  # [B]
    return Layout(
        leading=leading,
        flat=flat,
        rows=rows,
        mask=mask,
        targets=targets,
        invalid=invalid,
        sequence_kept=kept,
        padded_index=index,
        padded_shape=tuple(padded_shape),
        all_rows=linear and all_rows(check_finite, x.device),
    )


def _safe_targets(targets: Tensor, mask: Tensor, vocab: int, check_finite: bool) -> tuple[Tensor, Tensor | None]:
    """Checked targets as they are; unchecked ones (`check_finite=False`) with ids outside [0, V) set to 0, and the
    kept tokens that had one: no host sync, and a kernel never reads outside a row."""
    if check_finite:
        return targets, None
    outside = (targets < 0) | (targets >= vocab)  # [R, C]
    return targets.masked_fill(outside, 0), outside & mask


def all_rows(check_finite: bool, device: torch.device) -> bool:
    """Whether the fused lm_head runs every row, masked, instead of gathering the kept ones: only with the checks
    off inside a CUDA graph capture, where reading the kept-row count (one host sync, batched with the checks') is
    not allowed. Elsewhere that read costs less than the GEMMs on padding rows."""
    return not check_finite and device.type == "cuda" and torch.cuda.is_current_stream_capturing()

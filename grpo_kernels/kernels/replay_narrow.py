"""Sampling replay over the support's columns only: a window's kept tokens gathered into a narrow row.

The support of a window of rows z [C, V] (kept ids, or {z ≥ θ} of a rule) is gathered into z' [C, K + 1]: the
kept values at columns 0..K−1 (K the widest row's support, -inf padding) and the target's value in column K where
it lies outside the support (else -inf). The backend's plain pass on z' gives the same logp, lse and entropy as on
z masked with -inf, and its gradient, scattered back to the kept columns, is the masked pass's (0 elsewhere).

Why: a masked row is mostly -inf, and the CPU's vectorised exp takes several times longer on -inf than on a finite
value, so the backend's passes over it cost about twice the plain pass; a narrow support (kept ids, top-k's, a
min-p cut) takes a fraction of that. A support wider than V / `NARROW_FRACTION` (top-p alone on a flat
distribution) is masked in place instead: gathering and scattering it would cost more than it saves, and the
narrow rows' memory stays below a quarter of the window's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

NARROW_FRACTION = 4  # a rule's support is gathered when its widest row keeps at most V / 4 columns


@dataclass(frozen=True)
class Narrow:
    """A window's support gathered: `z` [C, K + 1] the kept values (-inf: padding) then the target's, `columns`
    [C, K + 1] int32 the vocabulary column of each (the target's last; 0 at padding, whose gradient is 0; int32
    halves what is held from the forward to the backward), `targets` [C] the target's column in z (K)."""

    z: Tensor
    columns: Tensor
    targets: Tensor


def kept_columns(ids: Tensor, vocab: int) -> Tensor:
    """Kept ids [C, K] (any order; -1, ids outside [0, V) and repeats: padding) as support columns [C, K] (int32):
    sorted, then V at padding, each id once."""
    columns = ids.sort(dim=-1).values
    padding = (columns < 0) | (columns >= vocab)
    padding[:, 1:] |= columns[:, 1:] == columns[:, :-1]
    return columns.masked_fill_(padding, vocab).to(torch.int32)


def columns_above(z: Tensor, theta: Tensor) -> Tensor | None:
    """The columns of {z ≥ θ} of each row of z [C, V] (θ [C, 1]), [C, K] int32 ascending, V at padding; None where a
    row keeps more than V / `NARROW_FRACTION` columns or its θ is NaN (a row holding NaN is left whole). One host
    read."""
    C, V = z.shape
    keep = z >= theta  # [C, V]
    counts = keep.sum(-1)  # [C]
    widest = int(counts.masked_fill(theta[:, 0].isnan(), V).max()) if C else 0
    if widest * NARROW_FRACTION > V:
        return None
    rows, cols = keep.nonzero(as_tuple=True)  # row-major: each row's columns ascending
    at = torch.arange(rows.shape[0], device=z.device) - (counts.cumsum(0) - counts)[rows]
    return torch.full((C, widest), V, dtype=torch.int32, device=z.device).index_put_((rows, at), cols.to(torch.int32))


def joined(pieces: list[Tensor], vocab: int) -> Tensor:
    """Windows' support columns [c_i, K_i] stacked into [C, max K_i], V at the added padding."""
    widest = max(piece.shape[1] for piece in pieces)
    return torch.cat([torch.nn.functional.pad(piece, (0, widest - piece.shape[1]), value=vocab) for piece in pieces])


def narrow(z: Tensor, targets: Tensor, columns: Tensor) -> Narrow:
    """The narrow rows of z [C, V] over `columns` [C, K] (V: padding; never the target) and the targets [C, 1]
    inside [0, V): the target in the last column, kept or not (the caller tells which)."""
    padding = columns >= z.shape[1]
    columns = columns.masked_fill(padding, 0)
    values = z.gather(1, columns).masked_fill_(padding, -math.inf)  # [C, K]
    columns = torch.cat([columns, targets.to(columns.dtype)], dim=1)
    at = torch.full_like(targets[:, 0], values.shape[1])
    return Narrow(torch.cat([values, z.gather(1, targets)], dim=1), columns, at)


def scatter_grad_(grad: Tensor, part: Narrow, out: Tensor) -> Tensor:
    """dL/dz [C, V] into `out` from the narrow rows' gradient `grad` [C, K + 1]: the kept columns' and the target
    column's, 0 elsewhere."""
    return out.zero_().scatter_add_(1, part.columns, grad)

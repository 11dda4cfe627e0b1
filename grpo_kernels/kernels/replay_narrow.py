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
    """A window's support gathered: `z` [C, K + 1] the kept values then the target's where it lies outside,
    `columns` [C, K + 1] int32 the vocabulary column of each (V: padding; the last, the target; int32 halves the
    memory they hold from the forward to the backward), `targets` [C] the target's column in z, `outside` [C]."""

    z: Tensor
    columns: Tensor
    targets: Tensor
    outside: Tensor


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
    """The narrow rows of z [C, V] over `columns` [C, K] (V: padding) and the targets [C, 1] inside [0, V)."""
    V, K = z.shape[1], columns.shape[1]
    padding = columns >= V
    values = z.gather(1, columns.masked_fill(padding, 0)).masked_fill_(padding, -math.inf)  # [C, K]
    hit = columns == targets  # [C, K]: at most one per row
    inside = hit.any(-1, keepdim=True)  # [C, 1]
    at = torch.where(inside, hit.to(torch.uint8).argmax(-1, keepdim=True), K)  # [C, 1]
    target_z = z.gather(1, targets).masked_fill_(inside, -math.inf)  # [C, 1]: kept at column K when outside
    z = torch.cat([values, target_z], dim=1)
    return Narrow(z, torch.cat([columns, targets.to(columns.dtype)], dim=1), at[:, 0], ~inside[:, 0])


def scatter_grad_(grad: Tensor, part: Narrow, out: Tensor) -> Tensor:
    """dL/dz [C, V] into `out` from the narrow rows' gradient `grad` [C, K + 1]: the kept columns' and the target
    column's, 0 elsewhere (padding's -inf has a gradient of 0, added at column 0)."""
    return out.zero_().scatter_add_(1, part.columns.masked_fill(part.columns >= out.shape[1], 0), grad)

"""Sampling replay over the support's columns only: a window's kept tokens gathered into narrow rows.

Where a window's support columns are known without a pass over its rows (kept ids; top-k's candidates, which hold
the whole support unless a tie at the k-th reaches beyond them), the support of z [C, V] is gathered into
z' [C, K + 1]: the kept values (-inf padding) and the target's value in the last column, which the support's
columns never repeat. The backend's plain pass on z' gives the same logp, lse and entropy as on z masked with
-inf (the target counted as kept either way), and its gradient, scattered back to the columns, is the masked
pass's (0 elsewhere).

Why: a masked row is mostly -inf, and the CPU's vectorised exp takes about four times longer on -inf than on a
finite value, so the backend's passes over a masked row cost about twice the plain pass; over K + 1 ≪ V columns
they cost next to nothing. A support found only by its threshold (min-p or top-p alone, the backward from a saved
θ) stays masked in place: listing the columns of {z ≥ θ} (a nonzero over the row) cost the CPU more than the
-inf it spares (measured on min-p 0.05's support, about a tenth of the vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Narrow:
    """A window's support gathered: `z` [C, K + 1] the kept values (-inf: padding) then the target's, `columns`
    [C, K + 1] the vocabulary column of each (the target's last; 0 at padding, whose gradient is 0), `targets` [C]
    the target's column in z (K)."""

    z: Tensor
    columns: Tensor
    targets: Tensor


def keep_ids_(z: Tensor, ids: Tensor) -> Tensor:
    """z [C, V] ← -inf outside each row's kept ids [C, K] (-1 or any id outside [0, V): padding), in place: the
    kept values gathered, the row filled, the values put back (no [C, V] mask). The masked form, for a vocabulary
    shard's rows, whose target may lie on another rank."""
    V = z.shape[-1]
    padding = (ids < 0) | (ids >= V)  # [C, K]
    at = ids.masked_fill(padding, 0)
    values = z.gather(1, at).masked_fill_(padding, -math.inf)  # [C, K]
    return z.fill_(-math.inf).scatter_reduce_(1, at, values, "amax")  # padding's -inf never wins over a kept value


def kept_columns(ids: Tensor, vocab: int) -> Tensor:
    """Kept ids [C, K] (any order; -1, ids outside [0, V) and repeats: padding) as support columns [C, K]: sorted,
    then V at padding, each id once."""
    columns = ids.sort(dim=-1).values
    padding = (columns < 0) | (columns >= vocab)
    padding[:, 1:] |= columns[:, 1:] == columns[:, :-1]
    return columns.masked_fill_(padding, vocab)


def narrow(z: Tensor, targets: Tensor, columns: Tensor) -> Narrow:
    """The narrow rows of z [C, V] over the support's `columns` [C, K] (V: padding) and the targets [C, 1] inside
    [0, V): the target in the last column, kept or not (the caller tells which), and nowhere else."""
    padding = (columns >= z.shape[1]) | (columns == targets)
    columns = columns.masked_fill(padding, 0)
    values = z.gather(1, columns).masked_fill_(padding, -math.inf)  # [C, K]
    columns = torch.cat([columns, targets.to(columns.dtype)], dim=1)
    at = torch.full_like(targets[:, 0], values.shape[1])
    return Narrow(torch.cat([values, z.gather(1, targets)], dim=1), columns, at)


def scatter_grad_(grad: Tensor, part: Narrow, out: Tensor) -> Tensor:
    """dL/dz [C, V] into `out` from the narrow rows' gradient `grad` [C, K + 1]: the kept columns' and the target
    column's, 0 elsewhere."""
    return out.zero_().scatter_add_(1, part.columns, grad)

"""A call's layout: where its tokens sit, padded `[B, T, ·]`, flat `[N, ·]` (log-prob inputs) or packed `[N, ·]`
(`cu_seqlens`). The vocabulary pass sees each as `[R, C, ·]` rows (`[B, T, ·]`, or `[1, N, ·]`); the loss algebra sees
a padded `[B, T]` (packed: `[S, T_max]`) view. `Layout` owns the passage between them: the rows, the checked mask and
targets, the user's index of a row, the padded and kept-token views, the sequence count and the output's shape.
Also here: the kept rows the fused lm_head gathers and scatters back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels.engine import validate


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token sits in the padded `[S, T_max]` view."""

    sequence: Tensor  # [N] sequence index of each token
    position: Tensor  # [N] position of each token inside its sequence
    num_sequences: int
    max_length: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, num_tokens: int) -> PackedLayout:
        """Check `cu_seqlens` (int, [S + 1], 0 first, N last, non-decreasing) and index the tokens."""
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [S + 1] of cumulative sequence starts")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        starts = cu_seqlens.long()
        lengths = starts[1:] - starts[:-1]  # [S]
        if int(starts[0]) != 0 or int(starts[-1]) != num_tokens or bool((lengths < 0).any()):
            raise ValueError(
                f"cu_seqlens must start at 0, end at N = {num_tokens} and never decrease, got {cu_seqlens.tolist()}"
            )
        sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=starts.device), lengths)  # [N]
        position = torch.arange(num_tokens, device=starts.device) - starts[sequence]  # [N]
        return cls(sequence, position, lengths.numel(), int(lengths.max()) if num_tokens else 0)

    def pad(self, packed: Tensor | None, fill: float | bool = 0) -> Tensor | None:
        """[N] -> [S, T_max], `fill` where a sequence is shorter; differentiable. None passes."""
        if packed is None:
            return None
        padded = packed.new_full((self.num_sequences, self.max_length), fill)  # [S, T_max]
        return padded.index_put((self.sequence, self.position), packed)


@dataclass(frozen=True)
class Layout:
    """Padded (`flat=False`: the user's `[B, T, ·]` are the rows) or flat (`[N, ·]` as one row `[1, N, ·]`), packed
    when `cu_seqlens` is given; `packed` indexes its sequences once the tokens are checked (`checked_tokens`)."""

    leading: tuple[int, ...]  # the user's leading dims: (B, T), or (N,)
    flat: bool
    cu_seqlens: Tensor | None = None
    packed: PackedLayout | None = None

    @classmethod
    def of(cls, name: str, x: Tensor, cu_seqlens: Tensor | None = None, *, flat_ok: bool = False) -> Layout:
        """The layout of logits or hidden states `x`: packed `[N, ·]` with cu_seqlens; else `[B, T, ·]`, or also
        `[N, ·]` where `flat_ok` (log-prob calls). A loss's padded `x` of another rank fails its source check."""
        if cu_seqlens is not None:
            if x.dim() != 2:
                raise ValueError(f"with cu_seqlens, {name} must be packed [N, ·], got {list(x.shape)}")
            return cls(tuple(x.shape[:1]), flat=True, cu_seqlens=cu_seqlens)
        if flat_ok and x.dim() not in (2, 3):
            raise ValueError(f"{name} must be [B, T, ·] or [N, ·], got {list(x.shape)}")
        return cls(tuple(x.shape[:-1]), flat=flat_ok and x.dim() == 2)

    def rows(self, x: Tensor) -> Tensor:
        """The user's `[B, T, ·]` / `[N, ·]` as the pass's rows `[R, C, ·]`."""
        return x[None] if self.flat else x

    def from_rows(self, x: Tensor) -> Tensor:
        """The pass's `[R, C]` back in the user's shape, `[B, T]` / `[N]`: the output's shape."""
        return x[0] if self.flat else x

    def checked_tokens(
        self, targets: Tensor, mask: Tensor | None, vocab: int, device: torch.device
    ) -> tuple[Layout, Tensor, Tensor]:
        """This layout (packed: its sequences indexed) with the targets and the mask (None: every token) checked,
        as `[R, C]` rows, the mask bool. The mask's values and the targets' range are value checks (`one_sync`)."""
        if not self.flat:
            B, T = self.leading
            mask = torch.ones((B, T), dtype=torch.bool, device=device) if mask is None else mask
            validate.check_mask(mask, B, T, device)
            validate.check_targets(targets, mask.bool(), vocab, device)
            return self, targets, mask.bool()
        (N,) = self.leading
        layout = self
        if self.cu_seqlens is not None:
            layout = dataclasses.replace(self, packed=PackedLayout.from_cu_seqlens(self.cu_seqlens.to(device), N))
        mask = torch.ones(N, dtype=torch.bool, device=device) if mask is None else mask
        validate.check_like("targets", targets, ((N,),), ("[N]",), device)
        validate.check_like("mask", mask, ((N,),), ("[N]",), device)
        validate.check_mask(mask[None], 1, N, device)
        validate.check_targets(targets[None], mask[None].bool(), vocab, device)
        return layout, targets[None], mask.bool()[None]

    def side_shapes(self) -> tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]]:
        """A per-token and a per-sequence tensor's shape and name: `(B, T)` "[B, T]" and `(B,)` "[B]", or `(N,)`
        "[N]" and `(S,)` "[S]"."""
        if self.flat:
            return (self.leading, "[N]"), ((self.num_sequences,), "[S]")
        return (self.leading, "[B, T]"), ((self.num_sequences,), "[B]")

    @property
    def num_sequences(self) -> int:
        """B, or S packed (1: flat log-prob inputs, one row)."""
        if self.packed is not None:
            return self.packed.num_sequences
        return 1 if self.flat else self.leading[0]

    def position(self, kept: tuple[Tensor, Tensor] | None = None) -> Callable[[int], object] | None:
        """The user's index, `(b, t)` or `n`, of the i-th row of the pass's flattened statistics (for error
        messages), through `kept` when the pass saw only the kept rows; None: that index in the rows' shape."""
        if kept is not None:
            return lambda i: int(kept[1][i]) if self.flat else (int(kept[0][i]), int(kept[1][i]))
        return (lambda i: i) if self.flat else None

    def sequence_kept(self, mask: Tensor) -> Tensor:
        """Whether each sequence of the `[R, C]` mask has a kept token, [B] / [S]."""
        if self.packed is None:
            return mask.any(1)  # [B]
        kept = torch.zeros(self.packed.num_sequences, dtype=torch.bool, device=mask.device)
        return kept.index_fill_(0, self.packed.sequence[mask[0]], True)  # [S]

    def is_per_token(self, x: Tensor | None) -> bool:
        """Whether `x` holds one value per token (the user's `[B, T]` / `[N]`), not one per sequence."""
        return x is not None and tuple(x.shape) == self.leading

    def padded(self, x: Tensor | None, fill: float | bool = 0) -> Tensor | None:
        """A per-token tensor (`[B, T]` / `[N]`) in the loss algebra's padded view `[B, T]` / `[S, T_max]`; a
        per-sequence one (`[B]` / `[S]`) and None pass."""
        if self.packed is None or not self.is_per_token(x):
            return x
        return self.packed.pad(x, fill)

    def padded_rows(self, x: Tensor | None, fill: float | bool = 0) -> Tensor | None:
        """The pass's `[R, C]` in the padded view; None passes."""
        return None if x is None else self.padded(self.from_rows(x), fill)

    def padded_views(self, rows: dict[str, Tensor | None], given: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        """The pass's `[R, C]` tensors `rows` and the user's per-token or per-sequence tensors `given`, by name, in
        the loss algebra's padded view (per-sequence ones and None pass)."""
        return {name: self.padded_rows(x) for name, x in rows.items()} | {
            name: self.padded(x) for name, x in given.items()
        }

    def at_kept(self, x: Tensor | None, kept: tuple[Tensor, Tensor]) -> Tensor | None:
        """A per-token or per-sequence tensor as one value per kept row (r, c) of the pass, [M]; None passes."""
        if x is None:
            return None
        r, c = kept
        if self.packed is None:
            return x[r, c] if x.dim() == 2 else x[r]
        return x[c] if self.is_per_token(x) else x[self.packed.sequence[c]]

    def padded_at_kept(self, x: Tensor, kept: tuple[Tensor, Tensor]) -> Tensor:
        """A padded-view tensor `[B, T]` / `[S, T_max]` at the kept rows (r, c) of the pass, [M]."""
        r, c = kept
        return x[r, c] if self.packed is None else x[self.packed.sequence[c], self.packed.position[c]]


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

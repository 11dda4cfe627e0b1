"""Packed (varlen) layout: sequences concatenated without padding, delimited by `cu_seqlens`.

The vocabulary pass runs on the packed `[N, V]` rows, so padding never enters it; the per-token results (O(N)
values) are then laid out as `[S, T_max]` for the loss algebra, which is how every sequence-level variant
reduces per segment with the same code as the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

"""Packed (varlen) sequences: concatenated without padding, delimited by `cu_seqlens` (the loss's side of that
layout is the engine's: `engine/layout.py`).

`PackedSequences` is the model-side layout of padding-free training: prompt ‖ completion sequences in one row, with
the positions and `cu_seqlens` a packed decoder forward takes and the completion tokens' `cu_seqlens` the loss takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedSequences:
    """Prompt ‖ completion sequences back to back in one row, without padding: the model's packed input and the loss's.

    Sequence s is `input_ids[cu_seqlens[s] : cu_seqlens[s + 1]]` with positions restarting at 0 (`position_ids`);
    its last `completion_lengths[s]` tokens are its completion. `cu_seqlens` (int32) is flash-attn's varlen layout of
    the model input; `completion_cu_seqlens` is the loss's over the N completion tokens; the hidden state at
    `completion_index - 1` predicts the token at `completion_index`. `from_padded` also keeps where each completion
    token sits in the padded `[S, T]` batch, so `pack` / `unpack` move per-token tensors between the two layouts.
    """

    input_ids: Tensor  # [N_in] long
    position_ids: Tensor  # [N_in] long, 0 at each sequence's first token
    cu_seqlens: Tensor  # [S + 1] int32
    max_length: int  # the longest sequence, flash-attn's max_seqlen
    completion_index: Tensor  # [N] long: where each completion token sits in input_ids
    completion_cu_seqlens: Tensor  # [S + 1] int32
    padded_index: Tensor | None = None  # [N] long: each completion token's flat index in the padded [S, T] batch
    padded_shape: tuple[int, int] | None = None  # (S, T) of that batch

    @classmethod
    def from_sequences(cls, sequences: list[Tensor], completion_lengths: list[int]) -> PackedSequences:
        """Pack 1-D token tensors (prompt ‖ completion each), the last `completion_lengths[s]` being completion."""
        if len(sequences) != len(completion_lengths) or not sequences:
            raise ValueError(
                f"sequences and completion_lengths must be non-empty and of one length, got {len(sequences)} "
                f"and {len(completion_lengths)}"
            )
        if any(not isinstance(s, Tensor) or s.dim() != 1 for s in sequences):
            raise ValueError("sequences must be 1-D token tensors (prompt ‖ completion)")
        device = sequences[0].device
        lengths = torch.tensor([s.numel() for s in sequences], device=device)  # [S]
        return cls._build(torch.cat(sequences).long(), lengths, torch.tensor(completion_lengths, device=device))

    @classmethod
    def from_padded(cls, input_ids: Tensor, attention_mask: Tensor, num_completion: int) -> PackedSequences:
        """Pack a padded `[S, P + T]` batch (left-padded prompts, right-padded completions: TRL's layout), keeping
        the tokens where `attention_mask` is 1, which must be one contiguous run per row; the completion is each
        row's kept tokens among the last `num_completion` columns."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must be [S, P + T] of one shape, got {list(input_ids.shape)} "
                f"and {list(attention_mask.shape)}"
            )
        if not 0 <= num_completion <= input_ids.shape[1]:
            raise ValueError(f"num_completion must be in [0, {input_ids.shape[1]}], got {num_completion}")
        keep = attention_mask.bool()  # [S, P + T]
        runs = (keep[:, :1].long() + (keep[:, 1:] & ~keep[:, :-1]).sum(1, keepdim=True)).squeeze(1)  # [S]
        if bool((runs > 1).any()):
            row = int((runs > 1).nonzero()[0])
            raise ValueError(
                "attention_mask must keep one contiguous run of tokens per row (left-padded prompt, right-padded "
                f"completion) to be packed; row {row} has {int(runs[row])}"
            )
        kept_completion = keep[:, input_ids.shape[1] - num_completion :]  # [S, T]
        packed = cls._build(input_ids[keep], keep.sum(1), kept_completion.sum(1))
        padded_index = kept_completion.flatten().nonzero().squeeze(1)  # [N]: row-major, as the packed order
        return dataclasses.replace(packed, padded_index=padded_index, padded_shape=tuple(kept_completion.shape))

    @classmethod
    def _build(cls, input_ids: Tensor, lengths: Tensor, completion_lengths: Tensor) -> PackedSequences:
        short = (completion_lengths > 0) & (completion_lengths >= lengths)  # [S]: no token predicts the first one
        if bool(short.any()) or bool((completion_lengths < 0).any()):
            row = int((short | (completion_lengths < 0)).nonzero()[0])
            raise ValueError(
                f"every sequence with a completion needs a prompt token before it (0 <= completion length < length); "
                f"sequence {row} has {int(lengths[row])} tokens and a completion of {int(completion_lengths[row])}"
            )
        device = input_ids.device
        zero = lengths.new_zeros(1)
        starts = torch.cat([zero, lengths.cumsum(0)])  # [S + 1]
        sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)  # [N_in]
        position_ids = torch.arange(input_ids.numel(), device=device) - starts[sequence]  # [N_in]
        ends = starts[1:]  # [S]
        owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), completion_lengths)  # [N]
        completion_starts = torch.cat([zero, completion_lengths.cumsum(0)])  # [S + 1]
        offset = torch.arange(owner.numel(), device=device) - completion_starts[owner]  # [N]
        completion_index = ends[owner] - completion_lengths[owner] + offset  # [N]
        return cls(
            input_ids=input_ids,
            position_ids=position_ids,
            cu_seqlens=starts.to(torch.int32),
            max_length=int(lengths.max()) if lengths.numel() else 0,
            completion_index=completion_index,
            completion_cu_seqlens=completion_starts.to(torch.int32),
        )

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def targets(self) -> Tensor:
        return self.input_ids[self.completion_index]  # [N]

    def pack(self, padded: Tensor | None) -> Tensor | None:
        """A per-completion-token `[S, T]` tensor of the padded batch -> `[N]`; a per-sequence `[S]` one and None
        pass unchanged."""
        if padded is None or padded.dim() == 1:
            return padded
        if self.padded_index is None or tuple(padded.shape[:2]) != self.padded_shape:
            raise ValueError(f"expected a [S, T] = {list(self.padded_shape or ())} tensor, got {list(padded.shape)}")
        return padded.flatten(0, 1)[self.padded_index]  # [N]

    def unpack(self, packed: Tensor, fill: float = 0.0) -> Tensor:
        """[N] -> the padded batch's `[S, T]`, `fill` where it holds no completion token."""
        if self.padded_index is None:
            raise ValueError("unpack needs a PackedSequences built by from_padded")
        S, T = self.padded_shape
        return packed.new_full((S * T,), fill).index_put((self.padded_index,), packed).view(S, T)  # [S, T]

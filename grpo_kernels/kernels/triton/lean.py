"""The vocabulary pass on 2-D tiles with the Triton kernels, for the lean fused lm_head: each vocabulary tile is a
split-V launch whose V-blocks write partial statistics; the partials of all the tiles of a row are merged once, by the
split pass's merge kernel, when the row's last tile is in. The backward kernel runs on a tile as it is: a target
outside the tile only never meets its one-hot. Targets are passed relative to the tile (any int32). Every launch is
one of the backend's custom ops (`ops.py`)."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs
from grpo_kernels.kernels.triton import ops


class TileStats:
    """The Triton counterpart of `torch/lean.py`'s `TileStats`: `add` each vocabulary tile, then `finish`."""

    def __init__(self, targets: Tensor, mask: Tensor | None, dtype: torch.dtype, opts):
        if mask is None:
            mask = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)
        self.targets, self.mask, self.opts = targets, mask.contiguous(), opts
        self.parts: list[Tensor] = []
        self.v_t = torch.zeros(targets.shape[0], dtype=torch.float32, device=targets.device)  # v at the target

    def add(self, x: Tensor, v0: int) -> None:
        """Fold the tile x [rows, w] (last stride 1), columns v0 .. v0 + w of the vocabulary."""
        opts = self.opts
        rel = (self.targets - v0).to(torch.int32)[None]  # [1, rows]
        args = VocabPassArgs(logits=x[None], targets=rel.contiguous(), mask=self.mask[None], **opts.pass_fields)
        partial = ops.token_logprobs_partials(args)
        inside = (rel[0] >= 0) & (rel[0] < x.shape[1])
        self.v_t = torch.where(inside, partial[7, :, 0], self.v_t)  # written only where the target is in the tile
        self.parts.append(partial)

    def finish(self, vocab: int) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
        """(logp, lse, entropy or None, {stat: [rows]}), float32; masked rows 0 (False)."""
        opts = self.opts
        partial = torch.cat(self.parts, dim=2)  # [PARTIAL_FIELDS, rows, all V-blocks]
        partial[7, :, 0] = self.v_t
        return ops.token_logprobs_merge(
            partial, self.mask, vocab, opts.temperature, opts.with_entropy, **opts.transform, stats=opts.stats
        )


def tile_grad_(x: Tensor, v0: int, targets: Tensor, mask: Tensor | None, grads: RowGrads, opts) -> None:
    """Overwrite the tile x [rows, w] (last stride 1) with dL/dx, as torch/lean.tile_grad_ (no row factor left)."""
    rel = (targets - v0).to(torch.int32)[None]
    if mask is None:
        mask = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)
    tile = x[None]  # [1, rows, w]: the logits and the buffer the gradient is written into (the in-place op)
    args = VocabPassArgs(logits=tile, targets=rel, mask=mask[None], **opts.pass_fields)
    ops.token_logprobs_bwd(args, grads.at(None), tile)

"""The backend protocol: the functions a backend's modules provide, named in its capability record
(`backend.CAPABILITIES`). Every tensor is on the logits' device; statistics are float32 (float64 for float64
logits). `kernels/README.md` walks through adding a backend.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import Tensor

VOCAB_PASS = ("token_logprobs_fwd", "token_logprobs_bwd")  # `Capabilities.module`
EPILOGUE = ("grpo_loss_fwd",)  # `Capabilities.epilogue_module`
TILES = ("TileStats", "tile_grad_")  # `Capabilities.tile_module` (the lean fused lm_head)


@functools.cache
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a pass over logits or hidden states of `dtype` computes in: float32 for bf16/fp16/fp32, float64 for
    float64 (cached: it runs on every call)."""
    return torch.promote_types(dtype, torch.float32)


class VocabPass(Protocol):
    """`Capabilities.module`: the vocabulary pass over logits [B, T, V] (rows of a chunk of the fused lm_head come
    as [1, c, V]); masked rows give 0 and are never read for their target."""

    def token_logprobs_fwd(self, logits: Tensor, targets: Tensor, mask: Tensor, temperature: float, with_entropy: bool,
                           *, logit_scale: float = 1.0, softcap: float | None = None, stats: tuple[str, ...] = ()
                           ) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:  # fmt: skip
        """logp, lse, entropy (None unless asked) [B, T] of z = c·tanh(s·x/c) / temperature, and each asked
        statistic by name (only with `Capabilities.stats`)."""

    def token_logprobs_bwd(self, logits: Tensor, targets: Tensor, mask: Tensor, lse: Tensor, entropy: Tensor | None,
                           grad_logp: Tensor | None, grad_entropy: Tensor | None, temperature: float, out: Tensor,
                           *, logit_scale: float = 1.0, softcap: float | None = None) -> None:  # fmt: skip
        """Write dL/dlogits into `out` (which may be the logits themselves): per kept row
        (g·(onehot − q) − g_H·q·(log q + H))·dz/dx, masked rows 0."""


class Epilogue(Protocol):
    """`Capabilities.epilogue_module`: the forward pass with a token-level loss formed in its epilogue."""

    def grpo_loss_fwd(self, logits: Tensor, targets: Tensor, mask: Tensor, weights: Tensor, advantages: Tensor,
                      old_logp: Tensor | None, ref_logp: Tensor | None, is_ratio: Tensor | None, epilogue,
                      temperature: float, with_entropy: bool, *, logit_scale: float = 1.0, softcap: float | None = None,
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:  # fmt: skip
        """logp, lse, entropy|None, each token's weighted loss and weighted dL/dlogp, [B, T] float32, 0 at masked
        rows. `epilogue` is the loss's plain record (`losses.epilogue.TokenEpilogue`: kind, clip widths, KL
        estimator among `Capabilities.epilogue_kl`, ...)."""

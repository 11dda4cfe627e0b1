"""GRPOLoss: an nn.Module holding one LossOptions, for trainers that configure the loss once."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from grpo_kernels.api import LossResult, fused_linear_grpo_loss, grpo_loss
from grpo_kernels.options import LossOptions, resolve_options


class GRPOLoss(nn.Module):
    """`GRPOLoss(loss_type="dapo", epsilon_high=0.28)` called as

        loss_fn(logits, targets, advantages, old_logp, ref_logp, mask)            # logits [B, T, V]
        loss_fn(hidden, weight, targets, advantages, old_logp, ref_logp, mask)    # fused lm_head, weight [V, H]

    Keyword arguments of the constructor are `LossOptions` fields (or one `options=`: a LossOptions or a paper
    preset) plus `backend`, `with_entropy`, `check_finite`, `inplace` (logits form) and `chunk_size`, `memory`,
    `tile`, `head_precision` (fused form: see `fused_linear_token_logprobs`);
    those of the call are the per-batch tensors (`is_ratio`, `token_weights`, `sequence_weights`, `bias`,
    `cu_seqlens`, `sampling_mask`, ...) and the process groups of a sharded vocabulary or split sequences
    (`process_group`, `vocab_start`, `sequence_group`).
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        inplace: bool = True,
        with_entropy: bool = False,
        chunk_size: int | None = None,
        memory: str = "auto",
        tile: tuple[int, int] | None = None,
        head_precision: str = "auto",
        check_finite: bool = True,
        options: LossOptions | None = None,
        **loss_options,
    ):
        super().__init__()
        self.options = resolve_options(options, loss_options)
        self.backend, self.inplace, self.with_entropy, self.chunk_size = backend, inplace, with_entropy, chunk_size
        self.check_finite = check_finite
        self.memory, self.tile, self.head_precision = memory, tile, head_precision

    def forward(self, hidden_or_logits: Tensor, *args: Tensor | None, **tensors: Tensor | bool | None) -> LossResult:
        common = dict(
            backend=self.backend, with_entropy=self.with_entropy, check_finite=self.check_finite, options=self.options
        )
        if is_fused_call(hidden_or_logits, args):
            fused = dict(chunk_size=self.chunk_size, memory=self.memory, tile=self.tile)
            fused["head_precision"] = self.head_precision
            return fused_linear_grpo_loss(hidden_or_logits, *args, **fused, **common, **tensors)
        return grpo_loss(hidden_or_logits, *args, inplace=self.inplace, **common, **tensors)

    def extra_repr(self) -> str:
        return f"{self.options}, backend={self.backend!r}, memory={self.memory!r}"


def is_fused_call(x: Any, args: tuple) -> bool:
    """Whether `GRPOLoss()(x, *args)` is the fused form (hidden, weight [V, H], targets, ...): a floating-point 2-D
    second argument whose last dimension is x's. Anything else is the logits form, whose checks name the argument
    (float targets among them)."""
    weight = args[0] if args else None
    if not (isinstance(x, Tensor) and isinstance(weight, Tensor) and weight.is_floating_point()):
        return False
    return weight.dim() == 2 and weight.shape[-1] == x.shape[-1]

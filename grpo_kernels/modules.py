"""GRPOLoss: an nn.Module holding one LossOptions, for trainers that configure the loss once."""

from __future__ import annotations

from torch import Tensor, nn

from grpo_kernels.api import grpo_loss
from grpo_kernels.losses.loss import GRPOLossOutput
from grpo_kernels.options import LossOptions


class GRPOLoss(nn.Module):
    """`GRPOLoss(loss_type="dapo", epsilon_high=0.28)(logits, targets, advantages, old_logp, ref_logp, mask)`.

    Keyword arguments are `LossOptions` fields; `backend`, `inplace` and `with_entropy` as in `grpo_loss`.
    """

    def __init__(self, *, backend: str = "auto", inplace: bool = True, with_entropy: bool = False, **loss_options):
        super().__init__()
        self.options = LossOptions.from_kwargs(**loss_options)
        self.backend = backend
        self.inplace = inplace
        self.with_entropy = with_entropy

    def forward(
        self,
        logits: Tensor,
        targets: Tensor,
        advantages: Tensor,
        old_logp: Tensor | None = None,
        ref_logp: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        is_ratio: Tensor | None = None,
    ) -> GRPOLossOutput:
        return grpo_loss(
            logits,
            targets,
            advantages,
            old_logp,
            ref_logp,
            mask,
            is_ratio=is_ratio,
            with_entropy=self.with_entropy,
            inplace=self.inplace,
            backend=self.backend,
            options=self.options,
        )

    def extra_repr(self) -> str:
        return f"{self.options}, backend={self.backend!r}"

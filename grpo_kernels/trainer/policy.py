"""PolicyModule: a causal LM with the fused lm_head + GRPO loss inside its `forward`.

The loss's lm_head matmul runs in `forward`, so DDP's gradient hooks and FSDP2's parameter gathering see it like any
other layer: the module DDP or FSDP2 wraps is this one, not the bare model. `logprobs` (old-policy and reference
log-probs, forward only) and `generate` (rollouts) are the other two entry points; under FSDP2 they are registered
as forward methods, so the sharded parameters are gathered for them too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_kernels.api import fused_linear_grpo_loss
from grpo_kernels.integrations.hf import completion_hidden_states, lm_head, logit_transform, policy_logprobs
from grpo_kernels.options import LossOptions


@dataclass(frozen=True)
class UpdateBatch:
    """The tensors of one (micro-)batch of the update; row i is one completion with its prompt."""

    input_ids: Tensor  # [B, P + T] prompt ‖ completion
    attention_mask: Tensor  # [B, P + T]
    completion_mask: Tensor  # [B, T] bool
    advantages: Tensor  # [B] or [B, T]
    old_logp: Tensor  # [B, T]
    ref_logp: Tensor | None = None  # [B, T]
    is_ratio: Tensor | None = None  # [B, T] or [B]
    token_weights: Tensor | None = None  # [B, T]
    sequence_weights: Tensor | None = None  # [B]

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, -self.completion_mask.shape[1] :]  # [B, T]

    def split(self, parts: int) -> list[UpdateBatch]:
        """`parts` micro-batches of consecutive rows (sizes differ by at most one); each must hold a row."""
        rows = self.input_ids.shape[0]
        if not 1 <= parts <= rows:
            raise ValueError(f"gradient_accumulation_steps must be in [1, {rows}] (rows per rank), got {parts}")
        index = torch.tensor_split(torch.arange(rows), parts)
        return [
            UpdateBatch(**{name: None if value is None else value[i] for name, value in vars(self).items()})
            for i in index
        ]


class PolicyModule(nn.Module):
    """The policy (`model`, a Hugging Face `*ForCausalLM`) with its GRPO loss, log-prob and sampling entry points."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: UpdateBatch, options: LossOptions) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, metrics) of the fused lm_head + GRPO loss on `batch`; the [B, T, V] logits are never stored.
        The model's own logit scaling and soft-capping (Gemma 2/3, Cohere, Granite) apply, as in `logprobs`."""
        weight, bias = lm_head(self.model)
        scale, softcap = logit_transform(self.model)
        options = dataclasses.replace(options, logit_scale=scale, final_logit_softcapping=softcap)
        mask = batch.completion_mask
        hidden = completion_hidden_states(self.model, batch.input_ids, batch.attention_mask, mask.shape[1])  # [B, T, H]
        out = fused_linear_grpo_loss(
            hidden,
            weight,
            batch.targets,
            batch.advantages,
            batch.old_logp,
            batch.ref_logp,
            mask,
            bias=bias,
            is_ratio=batch.is_ratio,
            token_weights=batch.token_weights,
            sequence_weights=batch.sequence_weights,
            with_entropy=True,
            options=options,
        )
        return out.loss, out.metrics

    @torch.no_grad()
    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, temperature: float
    ) -> tuple[Tensor, Tensor]:
        """(log π(completion token), entropy), each [B, T], 0 where masked; no gradients."""
        return policy_logprobs(
            self.model, input_ids, attention_mask, completion_mask, temperature=temperature, with_entropy=True
        )

    def generate(self, *args, **kwargs):
        """`model.generate` (the rollout engine's entry point)."""
        return self.model.generate(*args, **kwargs)

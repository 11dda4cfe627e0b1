"""The teacher of on-policy distillation in the GRPO step (`--teacher`, with `--teacher-kl-coef` and the loss option
`teacher_divergence`): a Hugging Face causal LM over the policy's vocabulary, loaded once, frozen, in eval mode.

For each micro-batch of the update it gives its completion hidden states, computed without gradient, and its
lm_head, which the fused loss takes as `teacher_hidden` / `teacher_weight` / `teacher_bias` (`teacher_term.py`).
It is a plain object, not a submodule of the policy, so DDP and FSDP2 neither wrap nor synchronise it, and
checkpoints do not hold it (a resumed run loads it again from `--teacher`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from grpo_kernels.distillation import divergence_options
from grpo_kernels.integrations.hf import completion_hidden_states, lm_head, logit_transform
from grpo_kernels.kernels.torch.divergence import Head
from grpo_kernels.options import LossOptions
from grpo_kernels.packing import PackedSequences


class Teacher:
    """A frozen teacher model: `inputs(...)` gives the fused loss's teacher keywords for a batch."""

    def __init__(self, model: nn.Module):
        self.model = model.eval().requires_grad_(False)

    def options(self, options: LossOptions) -> LossOptions:
        """`options` with the teacher head's own logit scaling and soft-capping (its config's, as the policy's are)."""
        scale, softcap = logit_transform(self.model)
        divergence = options.teacher_divergence or divergence_options()
        return dataclasses.replace(
            options, teacher_divergence=dataclasses.replace(divergence, teacher=Head(scale, softcap))
        )

    @torch.no_grad()
    def inputs(
        self, input_ids: Tensor, attention_mask: Tensor, num_completion: int, packed: PackedSequences | None
    ) -> dict[str, Tensor | None]:
        """{"teacher_hidden": [B, T, H_t] (packed: [N, H_t]), "teacher_weight", "teacher_bias"}: the teacher's
        completion hidden states (its padded pass, then packed like the policy's rows) and its lm_head."""
        hidden = completion_hidden_states(self.model, input_ids, attention_mask, num_completion)  # [B, T, H_t]
        weight, bias = lm_head(self.model)
        return {"teacher_hidden": hidden if packed is None else packed.pack(hidden), "teacher_weight": weight,
                "teacher_bias": bias}  # fmt: skip


def load_teacher(name: str, tokenizer, policy: nn.Module, dtype: torch.dtype, device: torch.device) -> Teacher:
    """The teacher from `name` (a model directory or hub name, `model.load_pretrained`), on `device` in `dtype`; a
    tokenizer or lm_head over another vocabulary than the policy's is a ValueError saying so."""
    from grpo_kernels.trainer.model import load_pretrained

    model, teacher_tokenizer = load_pretrained(name)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"teacher {name!r}: its tokenizer is not the policy's ({len(teacher_tokenizer)} tokens "
                         f"against {len(tokenizer)}, or the same count with other ids); on-policy distillation "
                         "compares the two models token by token over one vocabulary")  # fmt: skip
    rows, policy_rows = lm_head(model)[0].shape[0], lm_head(policy)[0].shape[0]
    if rows != policy_rows:
        raise ValueError(f"teacher {name!r}: its lm_head has {rows} rows, the policy's {policy_rows}: the two heads "
                         "must cover one vocabulary")  # fmt: skip
    return Teacher(model.to(device, dtype=dtype))

"""TRL's DistillationTrainer on `fused_linear_divergence`: a TRL script changes one import.

    from grpo_kernels.integrations.trl import DistillationTrainer   # was: from trl import DistillationTrainer

What changes: the loss. TRL's `_compute_loss` runs as it is (both models' last hidden states, the teacher under
no_grad, each head's logit scale and softcap read from its config, the loss mask with tool masks), and the one call it
makes to `_chunked_divergence_loss` goes to `chunked_divergence_loss` below, which has its arguments and returns:
`fused_linear_divergence` forms the student's gradients in its forward pass (4 GEMMs per chunk of tokens; TRL's
Function re-projects both heads in its backward: 6, 8 for the JSD). The config, generation, logging and numbers are
TRL's. FSDP2 heads (DTensor) are gathered once per call, as TRL does; ZeRO-3 heads (the student's, and the teacher's,
which TRL partitions too) by one `zero3.gathered` around the pass, as the GRPO drop-in's head.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

try:
    import trl
    from trl.trainer import distillation_trainer as trl_distillation
except ImportError as error:  # pragma: no cover - exercised only without TRL
    raise ImportError("grpo_kernels.integrations.trl needs TRL >= 1.16: pip install 'grpo-kernels[trl]'") from error

from grpo_kernels.distillation import fused_linear_divergence
from grpo_kernels.integrations import zero3

__all__ = ["DistillationTrainer", "chunked_divergence_loss"]


def chunked_divergence_loss(
    student_hidden_states: Tensor,
    teacher_hidden_states: Tensor,
    student_lm_head_weight: Tensor,
    teacher_lm_head_weight: Tensor,
    completion_mask: Tensor,
    beta: float,
    num_items_in_batch: Tensor | int | None = None,
    student_lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """TRL 1.16's `_chunked_divergence_loss` (same arguments; returns the loss, the student's entropy sum over the
    kept tokens and their count) on `fused_linear_divergence`."""
    student = _full(student_lm_head_weight, student_lm_head_bias, student_hidden_states.dtype)
    teacher = _full(teacher_lm_head_weight, teacher_lm_head_bias, teacher_hidden_states.dtype)
    with zero3.gathered(*student, *teacher):  # ZeRO-3: both heads whole for this pass (one gather)
        out = fused_linear_divergence(
            student_hidden_states,
            student[0],
            teacher_hidden_states,
            teacher[0],
            mask=completion_mask != 0,
            beta=beta,
            temperature=temperature,
            num_items_in_batch=num_items_in_batch,
            student_bias=student[1],
            teacher_bias=teacher[1],
            student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale,
            student_final_logit_softcapping=student_final_logit_softcapping,
            teacher_final_logit_softcapping=teacher_final_logit_softcapping,
        )
    return out.loss, out.entropy.sum(), out.num_valid


def _full(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """An FSDP2 head (DTensor) gathered once, the weight in the hidden states' dtype (TRL's handling); else as is."""
    if isinstance(weight, torch.distributed.tensor.DTensor):
        return weight.full_tensor().to(dtype), None if bias is None else bias.full_tensor()
    return weight, bias


@contextlib.contextmanager
def _fused_loss():
    """TRL's module-level loss function is `chunked_divergence_loss` inside (restored on the way out)."""
    stock = trl_distillation._chunked_divergence_loss
    trl_distillation._chunked_divergence_loss = chunked_divergence_loss
    try:
        yield
    finally:
        trl_distillation._chunked_divergence_loss = stock


class DistillationTrainer(trl.DistillationTrainer):
    """`trl.DistillationTrainer` with its loss computed by `fused_linear_divergence` (TRL's constructor and config)."""

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        with _fused_loss():
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)

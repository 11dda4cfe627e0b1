"""The TRL drop-in's config and head precision: `GRPOConfig` (TRL's config plus the fused head's `head_precision`,
the sampling replay's `replay_reference` and the sampler-sync guard's `sampler_sync`), TRL's `cast_lm_head_to_fp32`
read as head_precision="fp32", and the operands the fused passes take."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import trl
from torch import Tensor

from grpo_kernels.kernels.head_precision import HEAD_PRECISIONS, check_head_precision
from grpo_kernels.trainer.sampler_sync import SAMPLER_SYNC


@dataclasses.dataclass
class GRPOConfig(trl.GRPOConfig):
    """`trl.GRPOConfig` with the fused head's `head_precision` (a plain trl.GRPOConfig runs "auto", or "fp32"
    under `cast_lm_head_to_fp32`), `replay_reference` (a plain trl.GRPOConfig: False) and `rollout_correction`
    (`LossOptions.rollout_correction`; a plain trl.GRPOConfig: None, TRL's own correction)."""

    head_precision: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "Precision of the fused lm_head's logits GEMM: 'auto' (the lm_head's dtype), 'bf16', 'tf32' or "
            "'fp32' (float32 logits; the gradient GEMMs stay in the lm_head's dtype).",
            "choices": list(HEAD_PRECISIONS),
        },
    )
    sampler_sync: str = dataclasses.field(
        default="off",
        metadata={
            "help": "The sampler-sync guard on a training micro-batch's old and sampler log-probs (vLLM, or a "
            "rollout_func's): 'stop' raises StaleSampler before the backward when their mean gap over every "
            "process is over sampler_sync_tolerance, 'warn' warns, 'off' (default, TRL's behaviour) does nothing.",
            "choices": list(SAMPLER_SYNC),
        },
    )
    sampler_sync_tolerance: float | None = dataclasses.field(
        default=None,
        metadata={"help": "The guard's limit in nats per token (None: 1e-3 in fp32, 3e-2 in bf16 / fp16)."},
    )
    rollout_correction: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "The sampler-mismatch correction beyond TRL's four vllm_importance_sampling modes "
            "(docs/mismatch.md): a verl preset name (e.g. 'decoupled_k3_rs_token_tis'); in Python also a "
            "RolloutCorrection or a mapping of its fields. It replaces vllm_importance_sampling_correction and "
            "needs the sampler's log-probs (use_vllm)."
        },
    )
    replay_reference: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Replay the sampler's top_k / top_p / min_p on the reference model's log-probs too (default: the "
            "policy's old and current log-probs only; the KL to the reference stays full-vocabulary)."
        },
    )


def head_precision(args: trl.GRPOConfig) -> str:
    """The fused head's `head_precision` for a config: `GRPOConfig.head_precision`, with TRL's
    `cast_lm_head_to_fp32=True` read as "fp32" (a head_precision other than "auto" or "fp32" beside it raises)."""
    precision = getattr(args, "head_precision", "auto")
    check_head_precision(precision)
    if not args.cast_lm_head_to_fp32:
        return precision
    if precision not in ("auto", "fp32"):
        raise ValueError(f"cast_lm_head_to_fp32=True asks for a float32 head, head_precision={precision!r} another")
    return "fp32"


@contextlib.contextmanager
def head_operands(trainer: trl.GRPOTrainer, hidden: Tensor, weight: Tensor, bias: Tensor | None):
    """(hidden, weight, bias, head_precision) for the fused pass, autocast off inside it. With head_precision
    "auto" the operands are in the dtype TRL's head computes in (autocast's dtype when autocast is on, else the
    lm_head's); otherwise in the lm_head's dtype, and the fused head upcasts (or casts) them for the logits GEMM."""
    device = weight.device.type
    precision = head_precision(trainer.args)
    if precision == "auto" and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = weight.dtype
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731  differentiable: grads reach the parameters
    with torch.autocast(device, enabled=False):
        yield cast(hidden.to(weight.device)), cast(weight), cast(bias), precision

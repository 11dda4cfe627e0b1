"""A training step's model work: forward-only log-probs (old policy, reference), then μ fused-loss updates.

Every log-prob goes through the fused lm_head (`grpo_kernels.hf`): the `[B, T, V]` logits are never stored.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch
from torch import Tensor, nn

from grpo_kernels.api import fused_linear_grpo_loss
from grpo_kernels.distributed import num_items_in_batch
from grpo_kernels.hf import completion_hidden_states, lm_head, policy_logprobs
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.rollout import RolloutBatch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def forward_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float) -> Tensor | None:
    """log π(completion) [B, T] under `model` without gradients (0 where masked); None when model is None."""
    if model is None:
        return None
    return policy_logprobs(
        model, batch.input_ids, batch.attention_mask, batch.completion_mask, temperature=temperature
    )  # [B, T]


def importance_sampling_ratio(
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """π_old / π_sampler, TRL's `vllm_importance_sampling_*` correction: [B, T] for token modes, [B] for sequence
    modes (the product over the sequence's tokens). `*_truncate` clamps to [clip_min, clip_max]; `*_mask` sets
    ratios outside it to 0. It multiplies the policy term (`is_ratio`): the sampler (vLLM) and the trainer compute
    slightly different distributions, and the update must be for samples of π_old."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {mode!r}")
    log_diff = (old_logp - sampling_logp) * mask  # [B, T]
    if mode.startswith("sequence"):
        log_diff = log_diff.sum(dim=1)  # [B]
    ratio = torch.exp(log_diff)  # [B, T] or [B]
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampler_correction(old_logp: Tensor, batch: RolloutBatch, config) -> Tensor | None:
    """The `is_ratio` of TrainConfig's `vllm_importance_sampling_*` options, or None when the correction is off.
    With `HFRollout` it is 1 up to float error (the sampler is the policy itself): a live consistency check."""
    if not config.vllm_importance_sampling_correction:
        return None
    return importance_sampling_ratio(
        old_logp,
        batch.sampling_logp,
        batch.completion_mask,
        config.vllm_importance_sampling_mode,
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    )  # [B, T] or [B]


def inner_updates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    advantages: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    options: LossOptions,
    num_iterations: int,
    max_grad_norm: float,
) -> dict[str, float]:
    """μ = `num_iterations` optimizer steps on the same rollout batch with the fused lm_head + GRPO loss; the
    metrics are averaged over them. The token normaliser is the global token count (`num_items_in_batch`), so
    data-parallel ranks compute the same update as one process."""
    model.train()
    weight, bias = lm_head(model)
    targets, mask = batch.completion_ids, batch.completion_mask  # [B, T] each
    options = dataclasses.replace(options, num_items_in_batch=float(num_items_in_batch(mask)))
    totals: dict[str, float] = defaultdict(float)
    for _ in range(num_iterations):
        hidden = completion_hidden_states(model, batch.input_ids, batch.attention_mask, targets.shape[1])  # [B, T, H]
        out = fused_linear_grpo_loss(
            hidden,
            weight,
            targets,
            advantages,
            old_logp,
            ref_logp,
            mask,
            bias=bias,
            is_ratio=is_ratio,
            with_entropy=True,
            options=options,
        )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        totals["loss"] += out.loss.item()
        totals["grad_norm"] += grad_norm.item()
        for name, value in out.metrics.items():
            totals[name] += float(value)
    return {name: value / num_iterations for name, value in totals.items()}

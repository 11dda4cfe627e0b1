"""A training step's update: μ fused-loss optimizer steps, each
accumulated over micro-batches with the normalisers of the whole (global) step batch."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grpo_kernels.distributed import micro_batch_scale, num_items_in_batch, num_sequences_in_batch
from grpo_kernels.losses.mismatch import normaliser_mask
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.parallel import no_gradient_sync, unwrap
from grpo_kernels.trainer.policy import OwnPass, UpdateBatch, token_budget_groups, token_costs


class NonFiniteUpdate(ValueError):
    """An optimizer update refused because its grad_norm is not finite; the weights are those before it."""

    def __init__(self, metrics: dict[str, float]) -> None:
        name, value = next((n, v) for n, v in metrics.items() if not math.isfinite(v))
        super().__init__(f"{name} is {value}")
        self.metric = name


def inner_updates(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: UpdateBatch,
    *,
    options: LossOptions,
    num_iterations: int,
    max_grad_norm: float,
    gradient_accumulation_steps: int = 1,
    max_tokens_per_microbatch: int | None = None,
    own_pass: OwnPass | None = None,
    before_first_step: Callable[[dict[str, Tensor]], None] | None = None,
    first_metrics: Callable[[list[tuple[dict[str, float], float]]], None] | None = None,
) -> dict[str, float]:
    """μ = `num_iterations` optimizer steps on this rank's rollout batch with the fused lm_head + GRPO loss, each
    accumulated over micro-batches (`micro_batches`); the metrics are averaged over them.

    `policy` is the `PolicyModule`, bare or under DDP / FSDP2. The normalisers are those of the whole step batch
    (`num_items_in_batch`, `num_sequences_in_batch` all-reduced, `micro_batch_scale` for the rest), so K ranks × M
    micro-batches make the same update as one process on the whole batch. `loss` is the step batch's loss; the
    other metrics are token-weighted means over the micro-batches (averaged over ranks: the whole batch's means).
    An update whose grad_norm is not finite is not taken: `NonFiniteUpdate` names the first non-finite metric.
    With `own_pass` each micro-batch's forward is also its log-prob pass (`policy.own_pass_loss`); what the first
    update's passes report, rows joined in order, goes to `before_first_step` after their backward and before the first
    optimizer step (the sampler-sync guard, which may stop the step there); `first_metrics` gets the first update's
    metrics of each micro-batch with its token share there too (the guard reading the rollout correction's gap).
    Everything after `batch` is passed by keyword: the counts and the norm are numbers a positional swap would take.
    """
    policy.train()
    micro_batches = split_batch(batch, gradient_accumulation_steps, max_tokens_per_microbatch, policy)
    options, scales, shares = step_normalisers(options, micro_batches)
    totals: dict[str, float] = defaultdict(float)
    extra = () if own_pass is None else (own_pass,)
    for iteration in range(num_iterations):
        optimizer.zero_grad(set_to_none=True)
        reported: list[dict[str, Tensor]] = []
        micro_metrics: list[tuple[dict[str, float], float]] = []  # each micro-batch's metrics and token share
        for i, (micro, scale, share) in enumerate(zip(micro_batches, scales, shares, strict=True)):
            with no_gradient_sync(policy, sync=i == len(micro_batches) - 1):
                loss, metrics, *passed = policy(micro, options, *extra)
                (loss * scale).backward()
            totals["loss"] += loss.item() * scale
            values = {name: float(value) for name, value in metrics.items()}
            for name, value in values.items():
                totals[name] += value * share
            reported.extend(passed)
            micro_metrics.append((values, share))
        if iteration == 0 and before_first_step is not None:
            before_first_step({name: torch.cat([r[name] for r in reported]) for name in reported[0]})
        if iteration == 0 and first_metrics is not None:
            first_metrics(micro_metrics)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(norm):  # the norm of the reduced gradients: every rank refuses together
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdate({**totals, "grad_norm": norm})
        optimizer.step()
        totals["grad_norm"] += norm
    return {name: value / num_iterations for name, value in totals.items()}


def step_normalisers(
    options: LossOptions, micro_batches: list[UpdateBatch]
) -> tuple[LossOptions, list[float], list[float]]:
    """`options` with the whole step batch's normalisers (`num_items_in_batch`, `num_sequences_in_batch`, all-reduced),
    each micro-batch's loss scale (`micro_batch_scale`) and its token share × K (the metrics' weights).

    The loss's token counts leave out the tokens a decoupled rollout correction rejects
    (`losses.mismatch.normaliser_mask`: verl drops them from the response mask that its `batch_num_tokens` counts);
    sequence and row counts keep them (verl's `global_batch_size` is the mini-batch's rows), and so do the metrics'
    shares. A step whose every token is rejected has a zero loss: its token count is taken as 1 (verl's is 0, its
    loss NaN)."""
    masks = [micro.completion_mask for micro in micro_batches]
    correction = options.rollout_correction
    kept = [normaliser_mask(correction, m.old_logp, m.sampling_logp, m.completion_mask) for m in micro_batches]
    kept_count = float(num_items_in_batch(kept))
    count = kept_count if all(k is m for k, m in zip(kept, masks, strict=True)) else float(num_items_in_batch(masks))
    options = dataclasses.replace(
        options,
        num_items_in_batch=kept_count if kept_count > 0 or count == 0 else 1.0,  # no token at all: LossOptions' error
        num_sequences_in_batch=float(num_sequences_in_batch(masks)),
    )
    normaliser = options.loss_agg_mode or POLICY_LOSSES[options.loss_type].normaliser
    scales = [float(micro_batch_scale(normaliser, k, kept)) for k in kept]
    return options, scales, [float(mask.sum()) / max(count, 1.0) for mask in masks]


def split_batch(
    batch: UpdateBatch, gradient_accumulation_steps: int, max_tokens_per_microbatch: int | None, policy: nn.Module
) -> list[UpdateBatch]:
    """The micro-batches of one update (`micro_batch_rows`)."""
    groups = micro_batch_rows(batch, gradient_accumulation_steps, max_tokens_per_microbatch, policy)
    return [batch.rows(index) for index in groups]


def micro_batch_rows(
    batch, gradient_accumulation_steps: int, max_tokens_per_microbatch: int | None, policy: nn.Module
) -> list[Tensor]:
    """The rows (1-D long tensors of consecutive rows, in order) of each micro-batch of one update of `batch` (an
    `UpdateBatch` or a `RolloutBatch`): `gradient_accumulation_steps` of them (sizes differ by at most one), or,
    with a token budget, consecutive rows filled up to `max_tokens_per_microbatch` tokens of the policy's forward
    (real tokens when it is padding-free, else the padded width), at least `gradient_accumulation_steps` of them.
    Every rank makes as many as the rank that needs the most (FSDP2 gathers the parameters once per micro-batch, on
    every rank together). The π_old pass runs the same micro-batches, so its log-probs are the update pass's."""
    rows = batch.attention_mask.shape[0]
    if max_tokens_per_microbatch is None:
        if not 1 <= gradient_accumulation_steps <= rows:
            raise ValueError(
                f"gradient_accumulation_steps must be in [1, {rows}] (rows per rank), got {gradient_accumulation_steps}"
            )
        return list(torch.tensor_split(torch.arange(rows), gradient_accumulation_steps))
    padding_free = getattr(unwrap(policy), "padding_free", False)
    costs = token_costs(batch.attention_mask, padding_free)
    parts = len(token_budget_groups(costs, max_tokens_per_microbatch, gradient_accumulation_steps))
    if dist.is_available() and dist.is_initialized():
        count = torch.tensor(parts, device=batch.input_ids.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        parts = int(count)
    groups = token_budget_groups(costs, max_tokens_per_microbatch, parts)
    return [torch.tensor(group, dtype=torch.long) for group in groups]

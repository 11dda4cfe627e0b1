"""Sampling replay in the trainer: with truncated sampling (`top_k`, `top_p`, `min_p`, LossOptions' fields, which
both rollouts sample with) the policy's old and current log-probs are renormalised over the sampler's support, the
distribution the tokens were drawn from, so the importance ratio against the sampler and the sampler-sync guard
compare like with like. The reference model's log-probs stay over the whole vocabulary (NeMo RL's choice: the KL
pulls towards the reference's own distribution), unless `replay_reference`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_kernels.options import LossOptions

RULE = ("top_k", "top_p", "min_p")


def sampler_rule(options: LossOptions) -> dict[str, Any]:
    """The truncated sampler's rule, as keywords of the log-prob passes."""
    return {name: getattr(options, name) for name in RULE}


def truncates(options: LossOptions) -> bool:
    """Whether the rollouts sample from a truncated distribution (any of top_k, top_p, min_p on)."""
    return options.top_k > 0 or options.top_p < 1.0 or options.min_p > 0.0


def pass_keywords(options: LossOptions, stats: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keywords of a policy log-prob pass (`PolicyModule.logprobs`): with truncated sampling the sampler's rule
    and the statistics `log_kept_mass` and `stats` (a dict result), else none."""
    if not truncates(options):
        return {}
    return {**sampler_rule(options), "stats": ("log_kept_mass", *stats)}


def named_logprobs(out: tuple[Tensor, Tensor] | dict[str, Tensor]) -> dict[str, Tensor]:
    """A log-prob pass's result as a dict: {"logp", "entropy"} and the statistics it was asked for."""
    return out if isinstance(out, dict) else dict(zip(("logp", "entropy"), out, strict=True))


def old_policy_logprobs(
    policy, batch, options: LossOptions, micro_batches: list[Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log π_old, entropy, log kept mass or None) of the rollout `batch`'s completions, each [B, T]: over the
    sampler's support when sampling is truncated (the log kept mass log S ≤ 0 from the same pass), else over the
    whole vocabulary (no kept mass). `policy`: the `PolicyModule`. `micro_batches`: the update's rows
    (`update.micro_batch_rows`), one pass each, so that π_old is bitwise the update pass's log-probs at π_θ (None:
    one pass)."""
    mask = batch.completion_mask
    parts = [torch.arange(mask.shape[0])] if micro_batches is None else micro_batches
    inputs = (batch.input_ids, batch.attention_mask, mask)
    outs = [
        named_logprobs(policy.logprobs(*(x[rows] for x in inputs), options.temperature, **pass_keywords(options)))
        for rows in parts
    ]  # [b, T] each
    out = {name: torch.cat([o[name] for o in outs]) for name in outs[0]}  # [B, T] each, rows in order
    return out["logp"], out["entropy"], out.get("log_kept_mass")


def reference_rule(options: LossOptions, replay_reference: bool) -> dict[str, Any]:
    """The keywords of the reference model's log-prob pass: the sampler's rule with `replay_reference`, else none
    (the whole vocabulary)."""
    return sampler_rule(options) if replay_reference and truncates(options) else {}

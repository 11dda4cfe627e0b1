"""The TRL drop-in's one pass per step: where stock TRL 1.16 computes `old_per_token_logps` only for its vLLM
importance-sampling correction and π_old is π_θ at the update (`num_iterations` 1 and `steps_per_generation` equal to
`gradient_accumulation_steps`: one generation per optimizer step), the drop-in skips that no-grad forward.

TRL's generation then runs with a stand-in for the old log-probs (no pass), and what TRL derives from them (the
correction's ratio, its five `sampling/*` metrics) is dropped. Each training micro-batch's loss pass (the fused
log-probs, TRL's own loss algebra on them) gives π_old, detached: the ratio comes from it in TRL's chosen mode
(token / sequence × truncate / mask, a token the sampler could not score counted as ratio 1) before the loss reads it,
and the `sampling/*` metrics are TRL's over the generation batch, logged at its last micro-batch; the drop-in's
sampler-sync guard reads the same log-probs. With μ > 1 or a
generation spanning several optimizer steps nothing here applies.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from trl.trainer.utils import nanmax, nanmin

from grpo_kernels.integrations.trl_sampler_sync import check_trl_sampler_sync
from grpo_kernels.trainer.sampler_correction import importance_sampling_ratio

DIFF, RATIO = "sampling/sampling_logp_difference", "sampling/importance_sampling_ratio"
METRICS = (f"{DIFF}/mean", f"{DIFF}/max", f"{RATIO}/min", f"{RATIO}/mean", f"{RATIO}/max")


def fuses_old_pass(trainer) -> bool:
    """Whether stock TRL's old-log-prob pass exists only for the vLLM correction and π_old is π_θ at the update."""
    args = trainer.args
    return bool(
        trainer.use_vllm
        and trainer.vllm_importance_sampling_correction
        and trainer.num_iterations == 1
        and args.steps_per_generation == args.gradient_accumulation_steps
        and trainer.model.training
    )


@contextlib.contextmanager
def old_pass_skipped(trainer):
    """Around TRL's generation: its first log-prob pass (the old one; the reference's comes after) is `stand_in`."""
    trainer._gk_skip_old_pass = True
    try:
        yield
    finally:
        trainer._gk_skip_old_pass = False


def stand_in(trainer, input_ids: Tensor, logits_to_keep: int) -> tuple[Tensor, None, None] | None:
    """Zeros [B, T] for the skipped old-log-prob pass (once), else None: run the pass."""
    if not getattr(trainer, "_gk_skip_old_pass", False):
        return None
    trainer._gk_skip_old_pass = False
    return input_ids.new_zeros(input_ids.shape[0], logits_to_keep, dtype=torch.float32), None, None


def without_stand_in(trainer, output: dict) -> dict:
    """TRL's generation output and metrics without what it derived from the stand-in."""
    for name in METRICS:
        trainer._metrics["train"][name].pop()
    output.pop("old_per_token_logps")
    output.pop("importance_sampling_ratio")
    return output


def applies(trainer, inputs: dict) -> bool:
    """Whether this micro-batch's generation skipped the old pass (its π_old is the loss pass's)."""
    return "sampling_per_token_logps" in inputs and "old_per_token_logps" not in inputs and fuses_old_pass(trainer)


def correct(trainer, inputs: dict, logp: Tensor) -> None:
    """Set `inputs["importance_sampling_ratio"]` from the loss pass's log-probs `logp` [B, T] (π_old, detached) as
    TRL's generation would have, and record this micro-batch's share of TRL's `sampling/*` metrics."""
    sampled = inputs["sampling_per_token_logps"]  # [B, T]
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    scored = torch.where(torch.isnan(sampled), logp, sampled)  # no score: a log-ratio of 0, as TRL takes it
    mode = trainer.vllm_importance_sampling_mode
    ratio = importance_sampling_ratio(
        logp, scored, mask, mode, trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    )  # [B, T] or [B]
    ratio = ratio[:, None] if mode.startswith("sequence") else ratio  # TRL's [B, 1]
    inputs["importance_sampling_ratio"] = ratio
    check_trl_sampler_sync(trainer, trainer.model, {**inputs, "old_per_token_logps": logp})  # before the backward
    delta = (logp - sampled).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]  # [n]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask.bool()]
    record(trainer, delta, flat)


def record(trainer, delta: Tensor, ratio: Tensor) -> None:
    """Accumulate a micro-batch's gaps and ratios; at the generation batch's last micro-batch, log TRL's metrics
    (this process's means and extremes over the whole batch, then TRL's reduction over processes)."""
    stats = getattr(trainer, "_gk_sampling", None) or {"parts": [], "seen": 0}
    stats["parts"].append((delta.detach(), ratio.detach()))
    stats["seen"] += 1
    trainer._gk_sampling = stats
    if stats["seen"] < trainer.args.steps_per_generation:
        return
    trainer._gk_sampling = None
    delta = torch.cat([d for d, _ in stats["parts"]])
    ratio = torch.cat([r for _, r in stats["parts"]])
    zero = delta.new_zeros(())
    gather, metrics = trainer.accelerator.gather, trainer._metrics["train"]
    metrics[f"{DIFF}/mean"].append(gather(delta.mean() if delta.numel() else zero).mean().item())
    metrics[f"{DIFF}/max"].append(gather(delta.max() if delta.numel() else zero).max().item())
    metrics[f"{RATIO}/min"].append(nanmin(gather(ratio.min() if ratio.numel() else zero)).item())
    metrics[f"{RATIO}/mean"].append(gather(ratio.mean() if ratio.numel() else zero).nanmean().item())
    metrics[f"{RATIO}/max"].append(nanmax(gather(ratio.max() if ratio.numel() else zero)).item())

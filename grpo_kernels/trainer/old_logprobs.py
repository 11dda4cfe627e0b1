"""Where a step's π_old comes from (`TrainConfig.old_logprobs`), and why the separate π_old pass runs where it does.

- "update": π_old is π_θ at the update (μ = 1: one optimizer step per generation, over any number of micro-batches)
  and nothing reads π_old before the update, so the update pass's own log-probs, detached, are π_old
  (`policy.own_pass_loss`); no separate pass runs. This is what "auto" picks wherever it can.
- "pass": a separate no-grad pass of the whole batch before the update (`sampling_replay.old_policy_logprobs`),
  which "auto" picks where a component needs π_old first (`pass_reasons`).
- "sampler": verl's bypass mode, π_old := the sampler's log-probs (no pass, also at μ > 1); the importance ratio is
  then π_θ / π_sampler and there is no separate sampler correction. The sampler-sync guard compares the sampler
  with the first update pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_kernels.trainer import sampling_replay

if TYPE_CHECKING:
    from grpo_kernels.trainer.components import PresetComponents
    from grpo_kernels.trainer.config.record import TrainConfig

OLD_LOGPROBS = ("auto", "pass", "sampler")
BEFORE_UPDATE_INPUTS = ("mean_logp", "entropy")  # advantage inputs read from π_old's pass


def pass_reasons(config: TrainConfig, components: PresetComponents, dropout: tuple[str, ...] = ()) -> list[str]:
    """Why π_old is needed apart from the update pass: each reason a line (none: the update pass can give it).
    `dropout`: the policy's active dropout (`dropout.dropout_settings`)."""
    reasons = []
    if dropout:
        reasons.append(
            f"the policy's dropout ({', '.join(dropout)}) acts in the update pass, whose log-probs are then not the "
            "sampler's policy (--disable-dropout lets the update pass give π_old)"
        )
    if config.num_iterations > 1:
        reasons.append(f"num_iterations is {config.num_iterations}: π_old is the policy before the first of them")
    read = [n for n in BEFORE_UPDATE_INPUTS if n in components.advantage_input_names]
    if read:
        reasons.append(f"advantage {config.advantage!r} reads π_old's {', '.join(read)} before the update")
    if components.token_weights:
        reasons.append("regularizer 'tr_grpo' computes its token weights from π_old before the update")
    if components.learner is not None:
        reasons.append("learned sequence weights (λ-GRPO, DARO) are set for the update before it runs")
    if components.preference is not None:
        reasons.append("AMIR-GRPO's preference term runs its own update forward")
    if components.info is not None:
        reasons.append("Info-GRPO's entropy term runs its own update forward")
    correction = config.loss.rollout_correction
    if correction is not None and correction.rules and not correction.bypass_mode:
        reasons.append(
            "the decoupled rollout correction's rejection leaves its tokens out of the loss's token count, which is "
            "set from π_old before the update (verl's batch_num_tokens)"
        )
    if config.teacher is not None:
        reasons.append("the teacher term's fused pass takes π_old as an input (docs/distillation.md)")
    if sampling_replay.truncates(config.loss) and config.loss.replay_entropy == "full":
        reasons.append("replay_entropy 'full' needs the whole vocabulary's entropy, a pass of its own")
    return reasons


def old_logp_source(config: TrainConfig, components: PresetComponents, dropout: tuple[str, ...] = ()) -> str:
    """ "update", "pass" or "sampler" for `config.old_logprobs` with these components and the policy's active
    `dropout`; bypass mode with a component that needs the policy's own π_old before the update is a ValueError
    naming it."""
    reasons = pass_reasons(config, components, dropout)
    if config.old_logprobs == "sampler":
        refused = [r for r in reasons if not r.startswith(("num_iterations", "the policy's dropout"))]
        if refused:
            raise ValueError(f"old_logprobs 'sampler' (bypass mode) cannot serve: {'; '.join(refused)}")
        return "sampler"
    return "pass" if config.old_logprobs == "pass" or reasons else "update"

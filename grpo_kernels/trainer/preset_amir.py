"""AMIR-GRPO's preference term in the update (arXiv:2601.03661, spec §21): L = L_GRPO + λ·L_pref.

`PreferencePolicy` is the `PolicyModule` whose `forward` adds λ·L_pref to the fused GRPO loss. L_pref is
`amir_preference` on ℓ_θ(o_i) = Σ_t log π_θ(o_i,t), the per-sequence log-prob sums *with gradient*, which come from
`policy_logprobs`: the policy's forward through the fused lm_head (`fused_linear_token_logprobs`, no [B, T, V]
logits). It is a second forward of the policy: `fused_linear_grpo_loss` does not hand out the log-probs it computes.
The pairs (same group, reward gap > margin) use the preset's pipeline on the task's 0/1 verdict (2 × the verdict,
the code's 2.0/0.0 correctness scale: `RewardPipeline.on_verdict`); the reference-free mode (ℓ_ref ≡ 0) is the
code's default and the preset's.
λ is `AMIRLambda`'s, adapted once per step from the two losses (averaged over ranks, so every rank keeps the same λ)
before mixing, as in the code; it is in the checkpoint. Under data parallelism each rank averages over its own pairs
and DDP averages the ranks, as the reference trainer does per device.

The term needs the step's rewards for the rows it sees: the update must be one micro-batch per step and one inner
update (num_iterations = 1), which `amir_problems` checks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grpo_kernels.integrations.hf import policy_logprobs
from grpo_kernels.options import LossOptions
from grpo_kernels.regularizers import AMIRLambda, amir_preference
from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch


def amir_problems(config: Any) -> list[str]:
    """What in `config` keeps the preference term from seeing each step's rows once, in one forward."""
    problems = []
    if config.num_iterations != 1:
        problems.append(f"num_iterations = 1 (λ adapts once per step), got {config.num_iterations}")
    if config.gradient_accumulation_steps != 1 or getattr(config, "max_tokens_per_microbatch", None) is not None:
        problems.append(
            "one micro-batch per step (its pairs span a group): gradient_accumulation_steps = 1 and no "
            "max_tokens_per_microbatch"
        )
    return problems


class PreferencePolicy(PolicyModule):
    """`PolicyModule` with AMIR-GRPO's λ·L_pref added to its loss; `set_step` gives it the step's rewards."""

    def __init__(self, model: nn.Module, padding_free: bool = False, lam: float = 0.01, **kwargs: Any) -> None:
        super().__init__(model, padding_free)
        self.preference_kwargs = kwargs  # beta, margin, pair_mining, max_pairs_per_group
        self.lam = AMIRLambda(lam)
        self.step_rewards: Tensor | None = None
        self.step_group_ids: Tensor | None = None

    def set_step(self, rewards: Tensor, group_ids: Tensor) -> None:
        """This rank's step rewards [B] and group ids [B], for the pairs of the next `forward`."""
        self.step_rewards, self.step_group_ids = rewards, group_ids

    def forward(self, batch: UpdateBatch, options: LossOptions) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().forward(batch, options)
        rows = batch.completion_mask.shape[0]
        if self.step_rewards is None or len(self.step_rewards) != rows:
            got = None if self.step_rewards is None else len(self.step_rewards)
            raise ValueError(f"AMIR-GRPO: the forward sees {rows} rows, set_step gave rewards for {got}")
        mask = batch.completion_mask
        logp = policy_logprobs(
            self.model, batch.input_ids, batch.attention_mask, mask, temperature=options.temperature
        )  # [B, T] with gradient
        logp_sum = (logp * mask).sum(1)  # [B] ℓ_θ(o_i)
        preference = amir_preference(
            logp_sum,
            None,
            self.step_rewards.to(logp.device),
            self.step_group_ids.to(logp.device),
            lam=1.0,
            **self.preference_kwargs,
        )
        lam = self.lam.update(*_rank_means(loss.detach(), preference.detach()))
        metrics = {**metrics, "amir/preference": preference.detach(), "amir/lambda": torch.tensor(lam)}
        return loss + lam * preference, metrics

    def preference_state(self) -> dict:
        return {"lambda": self.lam.value}

    def load_preference_state(self, state: dict) -> None:
        self.lam.value = float(state["lambda"])


def _rank_means(*values: Tensor) -> list[float]:
    """The values averaged over the ranks (themselves in one process), as floats."""
    stacked = torch.stack([v.float() for v in values])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return stacked.tolist()

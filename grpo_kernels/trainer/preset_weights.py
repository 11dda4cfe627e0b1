"""Learned sequence weights of the presets, trained beside the policy from dL/dw: λ-GRPO's λ and DARO's w_μ.

The update multiplies each sequence's loss by a weight v_i, a leaf that collects dL/dv_i (`StepWeights.sequence`).
A learner turns that gradient into a step of its own parameters, with its own optimizer, and keeps both in the
checkpoint so an exact resume continues them. dL/dv_i is summed over micro-batches and, averaged over ranks as DDP
averages the policy's gradients, is the gradient of the one-process loss.

- λ-GRPO (arXiv:2510.06870): v = f_λ(lengths, groups) (`LambdaGRPOWeights`); λ follows dL/dλ, SGD lr 0.1 (spec §8).
- DARO (arXiv:2510.09001): each sequence of a prompt with pass rate μ ∈ (0, 1) falls in bin μ (`daro_buckets`, K =
  G − 1 bins, verdicts of the task); v_i = w_μ / N_μ with N_μ the bin's tokens over the global batch, so that the
  token-sum loss is Σ_μ w_μ L_μ, L_μ the bin's token-normalised loss; μ ∈ {0, 1} get v = 0. The w_μ step is that of
  `DAROWeights` (Σ_μ [w_μ L_μ − ln w_μ], w-gradient |L_μ| − 1/w_μ), with L_μ read from dL/dv: L_μ = Σ_{i∈μ} v_i ·
  dL/dv_i / w_μ. The paper gives no optimizer for w; SGD with λ-GRPO's lr 0.1 is this trainer's choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.presets import ComponentConfig
from grpo_kernels.regularizers import REGULARIZERS
from grpo_kernels.sampling import daro_buckets
from grpo_kernels.trainer.parallel import ParallelState

if TYPE_CHECKING:
    from grpo_kernels.trainer.step_records import StepSamples

LEARNING_RATE = 0.1  # SGD lr of the learned weights: λ-GRPO's community port (spec §8); DARO's is not given
LEARNED = ("lambda_grpo", "daro")  # regularizers that are learned sequence weights


class Learner:
    """One preset's learned sequence weights: `weights(step)` -> (v [B] attached to the parameters, step context);
    `learn(v, dL/dv, context)` -> metrics; `state_dict` / `load_state_dict` for the checkpoint."""

    def __init__(self, module: torch.nn.Module, parallel: ParallelState) -> None:
        self.module, self.parallel = module.to(parallel.device), parallel
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LEARNING_RATE)

    def weights(self, step: StepSamples, device: torch.device) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def learn(self, learned: Tensor, grad: Tensor, context: Any) -> dict[str, float]:
        raise NotImplementedError

    def _average_gradients(self) -> None:
        if self.parallel.world_size > 1:
            for p in self.module.parameters():
                dist.all_reduce(p.grad)
                p.grad /= self.parallel.world_size

    def state_dict(self) -> dict:
        return {"learned": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["learned"])
        self.optimizer.load_state_dict(state["optimizer"])


class LambdaLearner(Learner):
    """λ-GRPO: v = f_λ(lengths, group_ids); λ takes an SGD step on dL/dλ."""

    def weights(self, step: StepSamples, device: torch.device) -> tuple[Tensor, Any]:
        lengths = step.batch.completion_mask.sum(1).to(device)  # [B]
        return self.module(lengths, step.group_ids.to(device)), None  # [B]

    def learn(self, learned: Tensor, grad: Tensor, context: Any) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        learned.backward(grad)
        self._average_gradients()
        self.optimizer.step()
        return {"lambda_grpo/lambda": self.module.lam.item()}


class DAROLearner(Learner):
    """DARO: v_i = w_μ(i) / N_μ(i) (0 outside 0 < μ < 1); w takes an SGD step on Σ_μ [w_μ L_μ − ln w_μ]."""

    def __init__(self, module: torch.nn.Module, parallel: ParallelState) -> None:
        super().__init__(module, parallel)
        self.num_bins = len(module.u)

    def weights(self, step: StepSamples, device: torch.device) -> tuple[Tensor, Any]:
        bins = daro_buckets(step.correct, step.group_ids, self.num_bins).bins.to(device)  # [B] −1: μ ∈ {0, 1}
        lengths = step.batch.completion_mask.sum(1).to(device, torch.float32)  # [B]
        tokens = self._bin_sums(lengths, bins)  # [K] over every rank
        kept = bins >= 0  # [B]
        w = self.module.weights  # [K]
        safe = bins.clamp(min=0)  # [B]
        learned = torch.where(kept, w[safe] / tokens[safe].clamp(min=1.0), 0.0)  # [B]
        return learned, (bins, tokens)

    def learn(self, learned: Tensor, grad: Tensor, context: Any) -> dict[str, float]:
        bins, tokens = context
        w = self.module.weights.detach()  # [K]
        safe = bins.clamp(min=0)  # [B]
        shares = torch.where(bins >= 0, learned.detach() * grad / w[safe], 0.0)  # [B] Σ_t loss_t / N_μ, this rank
        bin_losses = self._bin_sums(shares, bins) / self.parallel.world_size  # [K] L_μ (DDP averages rank losses)
        self.optimizer.zero_grad(set_to_none=True)
        self.module(bin_losses, tokens > 0).backward()  # |L_μ| − 1/w_μ on the present bins
        self.optimizer.step()
        weights = self.module.weights.tolist()
        return {f"daro/w_{k + 1}": value for k, value in enumerate(weights)}  # bin k + 1: k + 1 correct of G

    def _bin_sums(self, values: Tensor, bins: Tensor) -> Tensor:
        """Σ of `values` [B] per bin [K] over every rank (bin −1 dropped)."""
        kept = bins >= 0
        sums = values.new_zeros(self.num_bins).index_add(0, bins[kept], values[kept])  # [K]
        if self.parallel.world_size > 1:
            dist.all_reduce(sums)
        return sums


def build_learner(
    regularizers: list[ComponentConfig], config: Any, parallel: ParallelState, problems: list[str]
) -> Learner | None:
    """The learner of the preset's learned regularizer (at most one, trained with num_iterations = 1: the update
    backpropagates once through its weights), or None; a problem for what cannot be learned."""
    if not regularizers:
        return None
    names = [r.name for r in regularizers]
    if len(regularizers) > 1 or config.num_iterations != 1:
        problems.append(f"regularizer(s) {names}: one learned weight at most, and num_iterations = 1")
        return None
    (r,) = regularizers
    if r.name == "lambda_grpo":
        return LambdaLearner(REGULARIZERS.get(r.name)(**r.kwargs), parallel)
    if config.loss.loss_agg_mode != "token-sum":
        problems.append(
            f"regularizer 'daro': its L_μ are token sums, so loss_agg_mode must be 'token-sum', got "
            f"{config.loss.loss_agg_mode!r}"
        )
        return None
    if config.num_generations < 2:
        problems.append(
            f"regularizer 'daro': needs num_generations >= 2 (pass-rate bins), got {config.num_generations}"
        )
        return None
    return DAROLearner(REGULARIZERS.get(r.name)(num_bins=config.num_generations - 1, **r.kwargs), parallel)

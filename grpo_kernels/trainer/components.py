"""A paper preset's rewards, sampler, advantage inputs and regularizers, applied by the trainer at every step.

`PresetComponents(config, task, parallel)` reads `config.preset` (a shipped name or a YAML path; None: the task's
reward alone, one round, no regularizer) and checks, before any model work, that the trainer can apply every
component: the ones it cannot are one ValueError naming the preset, each component and why. Per step:

- `collect`: prompts -> rollouts -> the task's scores -> the step reward of the preset's pipeline, with presets.py's
  semantics (`math_answer`, `gsm8k` and `countdown` stand for the task's verifier and are its full reward; the
  other entries are called with the per-step inputs their signature names, `REWARD_INPUTS`) -> the sampler
  (samplers.py). A reward's `old_logp` is the sampler's log-probs (π_old up to the sampler's numerics).
- `advantage_inputs`: the estimator's rewards and group ids, and the `ADVANTAGE_INPUTS` its signature names;
  an estimator with a `weights` parameter (GDPO) gets the reward matrix [B, K] and the entries' weights.
- `weights` and `learn`: the regularizers' token / sequence weights for `UpdateBatch`; λ-GRPO's λ is learned from
  dL/dw, the gradient the update leaves on its sequence weights, with its own SGD (lr 0.1, spec §8).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from grpo_kernels import presets
from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.presets import ComponentConfig
from grpo_kernels.regularizers import REGULARIZERS
from grpo_kernels.rewards import REWARDS
from grpo_kernels.trainer.parallel import ParallelState, gather_rows, local_rows
from grpo_kernels.trainer.rollout import Rollout, RolloutBatch
from grpo_kernels.trainer.samplers import (
    DynamicSampling,
    GPGResampling,
    Round,
    Sampler,
    XRPOAllocation,
    single_round,
)
from grpo_kernels.trainer.tasks import Prompt, PromptStream, RewardBatch, Task

if TYPE_CHECKING:
    from grpo_kernels.trainer.config import TrainConfig

VERIFIERS = ("math_answer", "gsm8k", "countdown")  # stand for the task's verifier: the task's full reward
REWARD_INPUTS = ("completions", "answers", "truncated", "lengths", "correct", "group_ids", "old_logp", "mask")
ADVANTAGE_INPUTS = ("correctness", "lengths", "mean_logp", "entropy", "mask")
PER_TOKEN_INPUTS = ("entropy", "mask")  # [B, T]: padded to a common T before gathering over ranks
MATRIX_WEIGHTS = "weights"  # an estimator with this parameter takes the reward matrix [B, K] and the weights w_k
TOKEN_WEIGHTS = ("tr_grpo",)  # fn(logp [B, T], **hyperparameters) -> token_weights [B, T] (detached)
LEARNED_SEQUENCE_WEIGHTS = ("lambda_grpo",)  # module(lengths [B], group_ids [B]) -> sequence_weights [B]
LAMBDA_LEARNING_RATE = 0.1  # λ-GRPO's SGD learning rate (community port, spec §8)
SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "dapo_dynamic": lambda config: DynamicSampling(config.prompts_per_step),
    "gpg_valid": lambda config, **kwargs: GPGResampling(**kwargs),
    "xrpo_allocate": lambda config, **kwargs: XRPOAllocation(**kwargs),
}
UNSUPPORTED = {  # why the trainer does not apply these components
    "pvpo_filter": "it needs reference-policy pre-rollouts per prompt and ground-truth trajectories from a larger LLM",
    "daro_buckets": "it only bins prompts for the daro regularizer",
    "daro": "not implemented yet (learned per-pass-rate-bin weights on prompts with 0 < pass rate < 1)",
    "amir": "its preference loss needs per-sequence log-prob sums with gradients, which PolicyModule does not return",
    "info_grpo": "it needs augmented rollouts π(·|q, z) and an extra loss term in the update",
}


@dataclass(frozen=True)
class StepSamples:
    """The rollouts a step trains on, after the sampler, with their rewards (`rewards` and `advantages` stay apart)."""

    batch: RolloutBatch
    group_ids: Tensor  # [B] long, dense, CPU
    rewards: Tensor  # [B] the step reward (the preset's pipeline), CPU
    terms: Tensor  # [B, K] the pipeline's entries, unweighted (GDPO's reward matrix)
    correct: Tensor  # [B] bool: the task's `answer` column > 0.5
    sequence_weights: Tensor | None  # [B] the sampler's (GPG's α)
    metrics: dict[str, float]


@dataclass(frozen=True)
class StepWeights:
    """The regularizers' weights for `UpdateBatch`; `learned` is `sequence` attached to learned parameters."""

    token: Tensor | None  # [B, T]
    sequence: Tensor | None  # [B]; a leaf that collects dL/dw when `learned` is set
    learned: Tensor | None  # [B]


def missing_advantage_inputs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[str]:
    """The required per-step inputs of an estimator that neither the trainer (`ADVANTAGE_INPUTS`) nor `kwargs` give."""
    return [n for n in _required(fn) if n not in ("rewards", "group_ids", *ADVANTAGE_INPUTS) and n not in kwargs]


class RewardPipeline:
    """A preset's `rewards` list as the step reward: r = Σ_k w_k·term_k in order; an entry that reads `rewards`
    replaces the sum so far by w·f(sum). Returns (rewards [B], the unweighted terms [B, K])."""

    def __init__(self, entries: tuple[ComponentConfig, ...], problems: list[str]) -> None:
        self.entries: list[tuple[float, Callable[..., Tensor] | None, dict[str, Any], bool]] = []
        for entry in entries:
            fn, kwargs = (None, {}) if entry.name in VERIFIERS else _reward_callable(entry, problems)
            reshapes = entry.name not in VERIFIERS and presets.reshapes_rewards(REWARDS.get(entry.name))
            self.entries.append((float(entry.weight), fn, kwargs, reshapes))
        self.weights = [weight for weight, *_ in self.entries]
        self.reshapes = any(reshapes for *_, reshapes in self.entries)
        self.identity = len(entries) == 1 and entries[0].name in VERIFIERS and entries[0].weight == 1.0
        self.uses_correctness = any(fn is not None and "correct" in _parameters(fn) for _, fn, _, _ in self.entries)

    def __call__(self, round: Round) -> tuple[Tensor, Tensor]:
        inputs = _reward_inputs(round)
        total, terms = None, []
        for weight, fn, kwargs, reshapes in self.entries:
            if fn is None:
                term = round.scores.rewards.float()  # [B] the task's verifier
            else:
                named = {name: inputs[name] for name in _parameters(fn) if name in inputs}
                term = fn(**named, **kwargs, **({"rewards": total} if reshapes else {})).float()  # [B]
            total = weight * term if total is None or reshapes else total + weight * term  # [B]
            terms.append(term)
        return total, torch.stack(terms, dim=1)  # [B], [B, K]


class PresetComponents:
    """The preset's components for `GRPOTrainer`; a ValueError listing every one the trainer cannot apply."""

    def __init__(self, config: TrainConfig, task: Task, parallel: ParallelState) -> None:
        self.config, self.task, self.parallel = config, task, parallel
        preset = None if config.preset is None else presets.load(config.preset)
        problems: list[str] = []
        estimator = ADVANTAGES.get(config.advantage)
        missing = missing_advantage_inputs(estimator, config.advantage_kwargs)
        if missing:
            problems.append(f"advantage {config.advantage!r}: needs {missing}, which the trainer cannot produce")
        parameters = _parameters(estimator)
        self.advantage_input_names = [
            n for n in ADVANTAGE_INPUTS if n in parameters and n not in config.advantage_kwargs
        ]
        entries = preset.rewards if preset is not None else (ComponentConfig("math_answer", {}, 1.0),)
        self.rewards = RewardPipeline(entries, problems)
        self.matrix = MATRIX_WEIGHTS in parameters
        if self.matrix and (self.rewards.reshapes or MATRIX_WEIGHTS in config.advantage_kwargs):
            problems.append(
                f"advantage {config.advantage!r}: takes one reward column per entry and its weight, so no entry "
                f"may reshape the rewards and advantage_kwargs may not set {MATRIX_WEIGHTS!r}"
            )
        self.sampler = self._sampler(preset.sampling if preset else None, problems)
        regularizers = preset.regularizers if preset else ()
        self.token_weights = [r for r in regularizers if r.name in TOKEN_WEIGHTS]
        self.learned, self.optimizer = self._learned(
            [r for r in regularizers if r.name in LEARNED_SEQUENCE_WEIGHTS], problems
        )
        for r in regularizers:
            if r.name not in TOKEN_WEIGHTS + LEARNED_SEQUENCE_WEIGHTS:
                problems.append(f"regularizer {r.name!r}: {UNSUPPORTED.get(r.name, 'unknown to the trainer')}")
        uses_correctness = self.rewards.uses_correctness or "correctness" in self.advantage_input_names
        if uses_correctness and tuple(task.reward_names[:1]) != ("answer",):
            problems.append(f"correctness: read from the task's first reward column 'answer', got {task.reward_names}")
        if problems:
            raise ValueError(f"preset {config.preset!r}: the trainer cannot apply " + "; ".join(problems))

    @property
    def advantage_kwargs(self) -> dict[str, Any]:
        """The estimator's hyperparameters: `config.advantage_kwargs`, and the reward weights for a matrix one."""
        extra = {MATRIX_WEIGHTS: self.rewards.weights} if self.matrix else {}
        return {**self.config.advantage_kwargs, **extra}

    # ------------------------------------------------------------------------------------------------- per step
    def collect(self, prompts: PromptStream, rollout: Rollout) -> StepSamples:
        """This rank's share of `prompts_per_step` fresh prompts -> G rollouts each -> rewards -> the sampler."""
        collected = self.sampler(_Rounds(self, prompts, rollout))
        round = collected.round
        group_ids = torch.unique(round.batch.group_ids.cpu(), return_inverse=True)[1]  # [B] dense
        rewards, terms = self.rewards(round)  # [B], [B, K]
        metrics = RewardBatch(rewards, round.scores.columns, round.scores.names).metrics(group_ids)
        if round.scores.over_limit is not None:  # completions over a reward's size or time limit, scored 0
            metrics["rewards/over_limit"] = float(round.scores.over_limit.sum())
        if not self.rewards.identity:
            metrics["rewards/task"] = round.scores.rewards.mean().item()
        weights = collected.sequence_weights
        metrics.update(collected.metrics)
        return StepSamples(round.batch, group_ids, rewards, terms, correctness(round.scores), weights, metrics)

    def advantage_inputs(self, step: StepSamples, old_logp: Tensor, entropy: Tensor) -> dict[str, Tensor]:
        """`rewards` ([B], or [B, K] for a matrix estimator), `group_ids` and the inputs the estimator names, on CPU."""
        mask = step.batch.completion_mask.to(old_logp.device)  # [B, T]
        lengths = mask.sum(1).float()  # [B]
        available = {
            "correctness": step.correct,  # [B]
            "lengths": lengths,  # [B]
            "mean_logp": (old_logp * mask).sum(1) / lengths.clamp(min=1),  # [B]
            "entropy": entropy,  # [B, T]
            "mask": mask,  # [B, T]
        }
        inputs = {"rewards": step.terms if self.matrix else step.rewards, "group_ids": step.group_ids}
        return {**inputs, **{name: available[name].cpu() for name in self.advantage_input_names}}

    def weights(self, step: StepSamples, old_logp: Tensor) -> StepWeights:
        """Token weights [B, T] (TR-GRPO's, from π_old: the policy of the first inner update) and sequence weights
        [B] (the sampler's times the learned ones)."""
        token = None
        for r in self.token_weights:
            factor = REGULARIZERS.get(r.name)(old_logp, **r.kwargs)  # [B, T]
            token = factor if token is None else token * factor
        sequence = None if step.sequence_weights is None else step.sequence_weights.to(old_logp.device)  # [B]
        if self.learned is None:
            return StepWeights(token, sequence, None)
        lengths = step.batch.completion_mask.sum(1).to(old_logp.device)  # [B]
        learned = self.learned(lengths, step.group_ids.to(old_logp.device))  # [B]
        learned = learned if sequence is None else learned * sequence
        return StepWeights(token, learned.detach().requires_grad_(), learned)

    def learn(self, weights: StepWeights) -> dict[str, float]:
        """One step of the learned weights' optimizer on dL/dw (left on `weights.sequence` by the update), averaged
        over ranks as DDP averages the policy's gradients; returns their values as metrics."""
        if weights.learned is None:
            return {}
        self.optimizer.zero_grad(set_to_none=True)
        weights.learned.backward(weights.sequence.grad)
        if self.parallel.world_size > 1:
            for p in self.learned.parameters():
                dist.all_reduce(p.grad)
                p.grad /= self.parallel.world_size
        self.optimizer.step()
        return {"lambda_grpo/lambda": self.learned.lam.item()}

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the components: the learned weights and their optimizer (empty without)."""
        if self.learned is None:
            return {}
        return {"learned": self.learned.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output; a checkpoint that lacks the learned weights this run has is an error."""
        if self.learned is None:
            return
        if "learned" not in state:
            raise ValueError("the checkpoint holds no learned sequence weights (it was written by another preset)")
        self.learned.load_state_dict(state["learned"])
        self.optimizer.load_state_dict(state["optimizer"])

    # --------------------------------------------------------------------------------------------- construction
    def _sampler(self, sampling: ComponentConfig | None, problems: list[str]) -> Sampler:
        if sampling is None:
            return single_round
        if sampling.name not in SAMPLERS:
            problems.append(f"sampler {sampling.name!r}: {UNSUPPORTED.get(sampling.name, 'unknown to the trainer')}")
        elif self.parallel.world_size > 1:
            problems.append(f"sampler {sampling.name!r}: not under data parallelism (ranks would keep different rows)")
        else:
            return SAMPLERS[sampling.name](self.config, **sampling.kwargs)
        return single_round

    def _learned(
        self, regularizers: list[ComponentConfig], problems: list[str]
    ) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None]:
        """The learned sequence-weight module and its optimizer: one module, trained with num_iterations = 1 (the
        update backpropagates once through its weights)."""
        if not regularizers:
            return None, None
        names = [r.name for r in regularizers]
        if len(regularizers) > 1 or self.config.num_iterations != 1:
            problems.append(f"regularizer(s) {names}: one learned weight at most, and num_iterations = 1")
            return None, None
        module = REGULARIZERS.get(regularizers[0].name)(**regularizers[0].kwargs).to(self.parallel.device)
        return module, torch.optim.SGD(module.parameters(), lr=LAMBDA_LEARNING_RATE)


class _Rounds:
    """The `Source` of the samplers: the trainer's prompt stream, rollout engine, task and reward pipeline."""

    def __init__(self, components: PresetComponents, prompts: PromptStream, rollout: Rollout) -> None:
        self.components, self.prompts, self.rollout = components, prompts, rollout
        self.num_generations = components.config.num_generations

    def draw(self) -> list[Prompt]:
        """The same draw on every rank; each keeps its share."""
        count = self.components.config.prompts_per_step
        return self.prompts.next(count)[local_rows(count, self.components.parallel)]

    def generate(self, prompts: list[Prompt], num_generations: int) -> Round:
        batch = self.rollout.generate([p.text for p in prompts], num_generations)
        answers = [prompts[i].answer for i in batch.group_ids.tolist()]
        return Round(prompts, batch, self.components.task.score(batch.completions, answers, batch.truncated))

    def rewards(self, round: Round) -> Tensor:
        return self.components.rewards(round)[0]  # [B]


# ------------------------------------------------------------------------------------------- inputs and gathering
def gather_inputs(inputs: dict[str, Tensor], parallel: ParallelState) -> dict[str, Tensor]:
    """Every rank's advantage inputs concatenated in rank order, on CPU: group ids offset by rank so that groups stay
    apart, per-token inputs right-padded to the longest T over the ranks (masked there)."""
    if parallel.world_size == 1:
        return inputs
    rows = len(inputs["group_ids"])
    per_token = [name for name in PER_TOKEN_INPUTS if name in inputs]  # the same names on every rank
    width = torch.tensor(max([inputs[name].shape[1] for name in per_token], default=0), device=parallel.device)
    if per_token:
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
    gathered = {}
    for name, value in inputs.items():
        value = value + parallel.rank * rows if name == "group_ids" else value
        value = F.pad(value, (0, int(width) - value.shape[1])) if name in PER_TOKEN_INPUTS else value
        flags = value.dtype == torch.bool
        value = gather_rows((value.long() if flags else value).to(parallel.device), parallel).cpu()  # [K·B, ...]
        gathered[name] = value.bool() if flags else value
    return gathered


def local_part(advantages: Tensor, rows: int, length: int, parallel: ParallelState) -> Tensor:
    """This rank's rows (and first `length` positions, for per-token advantages) of the gathered advantages."""
    part = advantages[parallel.rank * rows : (parallel.rank + 1) * rows]  # [B] or [B, T_max]
    return part[:, :length] if part.dim() == 2 else part


def correctness(scores: RewardBatch) -> Tensor:
    """The verifier's verdict [B] bool: the task's first reward column, `answer` (1.0 / 0.0), above 0.5."""
    return scores.columns[:, 0] > 0.5  # [B]


def _reward_inputs(round: Round) -> dict[str, Any]:
    batch = round.batch
    mask = batch.completion_mask.cpu()  # [B, T]
    return {
        "completions": batch.completions,
        "answers": round.answers,
        "truncated": batch.truncated.cpu(),  # [B]
        "lengths": mask.sum(1).float(),  # [B]
        "correct": correctness(round.scores),  # [B]
        "group_ids": batch.group_ids.cpu(),  # [B]
        "old_logp": batch.sampling_logp.cpu(),  # [B, T]
        "mask": mask,
    }


def _reward_callable(
    entry: ComponentConfig, problems: list[str]
) -> tuple[Callable[..., Tensor] | None, dict[str, Any]]:
    """The reward's function and its hyperparameters (a class is built from them), or None after a problem."""
    obj = REWARDS.get(entry.name)
    if inspect.isclass(obj):
        if _required(obj):
            problems.append(f"reward {entry.name!r}: is built from {_required(obj)}, which a preset cannot give")
            return None, {}
        fn, kwargs = obj(**entry.kwargs), {}
    else:
        fn, kwargs = obj, entry.kwargs
    missing = [n for n in _required(fn) if n not in REWARD_INPUTS and n != "rewards" and n not in kwargs]
    if missing:
        problems.append(f"reward {entry.name!r}: needs {missing}, which the trainer cannot produce")
        return None, {}
    return fn, kwargs


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind not in variadic}


def _required(fn: Callable[..., Any]) -> list[str]:
    return [n for n, p in _parameters(fn).items() if p.default is inspect.Parameter.empty]

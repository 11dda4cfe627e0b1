"""A paper preset's rewards, sampler, advantage inputs and regularizers, applied by the trainer at every step.

`PresetComponents(config, task, parallel)` reads `config.preset` (a shipped name or a YAML path; None: the task's
reward alone, one round, no regularizer) and checks, before any model work, that the trainer can apply every
component: the ones it cannot are one ValueError naming the preset, each component and why (for an input no
shipped task or model gives: which input and why). This module dispatches; the inputs and state some papers need
live beside it:

- `collect`: prompts -> rollouts -> the task's scores -> the step reward of the preset's pipeline
  (`preset_rewards.py`, with the inputs `preset_inputs.py` produces: GAPO's answer keys, SPO's correct-prefix
  scores, RankGRPO's ranks, DRA-GRPO's policy embeddings) -> the sampler (samplers.py; PVPO's `pvpo_filter` in
  `preset_pvpo.py`). A reward's `old_logp` is the sampler's log-probs (π_old up to the sampler's numerics).
- `advantage_inputs`: the estimator's rewards and group ids, and the `ADVANTAGE_INPUTS` its signature names (PVPO's
  cached reference value too); an estimator with a `weights` parameter (GDPO) gets the reward matrix [B, K] and the
  entries' weights.
- `weights` and `learn`: the regularizers' token / sequence weights for `UpdateBatch`; λ-GRPO's λ and DARO's w_μ
  are learned from dL/dw, the gradient the update leaves on its sequence weights (`preset_weights.py`).
  AMIR-GRPO's preference term is in the policy's forward (`policy_module`, `preset_amir.py`).
- `bind_policy`: the policy, tokenizer and reference model, for the inputs read from them.
- `state_dict`: what a checkpoint keeps (learned weights, AMIR's λ, PVPO's reference values) for an exact resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from grpo_kernels import presets
from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.presets import ComponentConfig
from grpo_kernels.regularizers import REGULARIZERS
from grpo_kernels.shown import shown
from grpo_kernels.trainer.parallel import ParallelState, gather_rows, local_rows
from grpo_kernels.trainer.policy import PolicyModule
from grpo_kernels.trainer.preset_amir import PreferencePolicy, amir_problems
from grpo_kernels.trainer.preset_info import InfoPolicy, InfoRounds, augmentation, info_problems
from grpo_kernels.trainer.preset_inputs import RewardInputs
from grpo_kernels.trainer.preset_pvpo import build_pvpo
from grpo_kernels.trainer.preset_rewards import RewardPipeline, parameters, required
from grpo_kernels.trainer.preset_weights import LEARNED, build_learner
from grpo_kernels.trainer.rollout import Rollout
from grpo_kernels.trainer.samplers import (
    GLOBAL_SAMPLERS,
    GPG_MAX_ROUNDS,
    MAX_NUM_GEN_BATCHES,
    DynamicSampling,
    GPGResampling,
    Round,
    Sampler,
    XRPOAllocation,
    single_round,
)
from grpo_kernels.trainer.sampling_replay import sampler_rule
from grpo_kernels.trainer.step_records import StepSamples, StepWeights
from grpo_kernels.trainer.tasks import Prompt, PromptStream, RewardBatch, Task

if TYPE_CHECKING:
    from grpo_kernels.trainer.config.record import TrainConfig

ADVANTAGE_INPUTS = ("correctness", "lengths", "mean_logp", "entropy", "mask")
PRODUCED_ADVANTAGE_INPUTS = ("reference_value",)  # PVPO's V̂(q), from reference pre-rollouts (preset_pvpo.py)
NO_ADVANTAGE_SOURCE = {  # advantage inputs no shipped task gives
    "strata": "Stratified-GRPO's strata are a trajectory's structure (its number of search or tool calls, from an "
    "agent loop); the shipped tasks are single-turn without tools, and a prompt-level key (difficulty, problem type) "
    "never splits a group, so with the preset's per_group: true the advantage would be GRPO's",
}
PER_TOKEN_INPUTS = ("entropy", "mask")  # [B, T]: padded to a common T before gathering over ranks
MATRIX_WEIGHTS = "weights"  # an estimator with this parameter takes the reward matrix [B, K] and the weights w_k
TOKEN_WEIGHTS = ("tr_grpo",)  # fn(logp [B, T], **hyperparameters) -> token_weights [B, T] (detached)
POLICY_TERMS = ("amir", "info_grpo")  # loss terms the policy's forward adds (preset_amir.py, preset_info.py)
SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "dapo_dynamic": lambda config: DynamicSampling(config.prompts_per_step, _limit(config, MAX_NUM_GEN_BATCHES)),
    "gpg_valid": lambda config, **kwargs: GPGResampling(**{"max_rounds": _limit(config, GPG_MAX_ROUNDS), **kwargs}),
    "xrpo_allocate": lambda config, **kwargs: XRPOAllocation(**kwargs),
}


def _limit(config: TrainConfig, default: int) -> int:
    """A sampler's round limit: `--max-num-gen-batches` when given, else the sampler's own."""
    return default if config.max_num_gen_batches is None else config.max_num_gen_batches


UNSUPPORTED: dict[str, str] = {}  # why the trainer does not apply a known component


def missing_advantage_inputs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[str]:
    """The required per-step inputs of an estimator that neither the trainer (`ADVANTAGE_INPUTS`) nor `kwargs` give."""
    given = ("rewards", "group_ids", *ADVANTAGE_INPUTS, *PRODUCED_ADVANTAGE_INPUTS)
    return [n for n in required(fn) if n not in given and n not in kwargs]


class PresetComponents:
    """The preset's components for `GRPOTrainer`; a ValueError listing every one the trainer cannot apply."""

    def __init__(self, config: TrainConfig, task: Task, parallel: ParallelState) -> None:
        self.config, self.task, self.parallel = config, task, parallel
        preset = None if config.preset is None else presets.load(config.preset)
        problems: list[str] = []
        estimator = ADVANTAGES.get(config.advantage)
        missing = missing_advantage_inputs(estimator, config.advantage_kwargs)
        if missing:
            reasons = "".join(f" ({n}: {NO_ADVANTAGE_SOURCE[n]})" for n in missing if n in NO_ADVANTAGE_SOURCE)
            problems.append(
                f"advantage {shown(config.advantage)}: needs {missing}, which the trainer cannot produce{reasons}"
            )
        named = parameters(estimator)
        self.advantage_input_names = [
            n
            for n in (*ADVANTAGE_INPUTS, *PRODUCED_ADVANTAGE_INPUTS)
            if n in named and n not in config.advantage_kwargs
        ]
        budget = config.max_completion_length  # rewards' token lengths (DAPO's L_max, L_cache) scale to it
        default = (ComponentConfig("math_answer", {}, 1.0),)
        entries = presets.rewards_for_budget(preset, budget) if preset is not None else default
        self.inputs = RewardInputs(task, parallel.mode)
        self.rewards = RewardPipeline(entries, problems, self.inputs)
        self.matrix = MATRIX_WEIGHTS in named
        if self.matrix and (self.rewards.reshapes or MATRIX_WEIGHTS in config.advantage_kwargs):
            problems.append(
                f"advantage {shown(config.advantage)}: takes one reward column per entry and its weight, so no entry "
                f"may reshape the rewards and advantage_kwargs may not set {MATRIX_WEIGHTS!r}"
            )
        filtering = preset is not None and preset.sampling is not None and preset.sampling.name == "pvpo_filter"
        self.reference, self.pvpo_filter = None, None
        if filtering or "reference_value" in named:
            self.reference, self.pvpo_filter = build_pvpo(
                config, task, parallel.world_size, lambda r: self.rewards(r)[0], filtering, problems
            )
        self.sampler = self._sampler(preset.sampling if preset else None, problems)
        regularizers = preset.regularizers if preset else ()
        self.token_weights = [r for r in regularizers if r.name in TOKEN_WEIGHTS]
        self.learner = build_learner([r for r in regularizers if r.name in LEARNED], config, parallel, problems)
        self.preference, self.info = self._policy_terms(regularizers, problems)  # kwargs of the forward's term
        self.policy: PreferencePolicy | InfoPolicy | None = None
        self.generation_seconds = 0.0  # the latest `collect`'s time in the rollout engine
        if self.info is not None:
            self.sampler = InfoRounds(augmentation(task))
        for r in regularizers:
            if r.name not in (*TOKEN_WEIGHTS, *LEARNED, *POLICY_TERMS):
                problems.append(f"regularizer {r.name!r}: {UNSUPPORTED.get(r.name, 'unknown to the trainer')}")
        uses_correctness = self.rewards.uses_correctness or "correctness" in self.advantage_input_names
        if uses_correctness and tuple(task.reward_names[:1]) != ("answer",):
            problems.append(f"correctness: read from the task's first reward column 'answer', got {task.reward_names}")
        if problems:
            raise ValueError(f"preset {shown(config.preset)}: the trainer cannot apply " + "; ".join(problems))

    def bind_policy(self, model: torch.nn.Module, tokenizer: Any, ref_model: torch.nn.Module | None = None) -> None:
        """Give the inputs read from the policy (DRA-GRPO's embeddings, PVPO's injected log-probs) its model and
        tokenizer, and PVPO's pre-rollouts the reference model, once they exist."""
        self.inputs.embedder.bind(model, tokenizer)
        if self.reference is not None:
            budget, loss = self.config.max_completion_length, self.config.loss
            self.reference.bind(ref_model, tokenizer, budget, loss.temperature, **sampler_rule(loss))
        if self.pvpo_filter is not None:
            self.pvpo_filter.bind(model, tokenizer, self.config.max_completion_length)

    def policy_module(self, model: torch.nn.Module, padding_free: bool) -> PolicyModule:
        """The module the update runs (DDP / FSDP2 wrap it): `PolicyModule`, or the one that adds a preset's term to
        the loss (AMIR-GRPO's `PreferencePolicy`, Info-GRPO's `InfoPolicy`)."""
        if self.info is not None:
            self.policy = InfoPolicy(model, padding_free, **self.info)
        elif self.preference is not None:
            self.policy = PreferencePolicy(model, padding_free, **self.preference)
        return PolicyModule(model, padding_free) if self.policy is None else self.policy

    @property
    def advantage_kwargs(self) -> dict[str, Any]:
        """The estimator's hyperparameters: `config.advantage_kwargs`, and the reward weights for a matrix one."""
        extra = {MATRIX_WEIGHTS: self.rewards.weights} if self.matrix else {}
        return {**self.config.advantage_kwargs, **extra}

    # ------------------------------------------------------------------------------------------------- per step
    def collect(self, prompts: PromptStream, rollout: Rollout) -> StepSamples:
        """This rank's share of `prompts_per_step` fresh prompts -> G rollouts each -> rewards -> the sampler;
        `generation_seconds` is then the time its rollouts took."""
        self.generation_seconds = 0.0
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
        inputs = {} if self.reference is None else {"reference_value": self.reference.values(round)}  # [B]
        if isinstance(self.sampler, InfoRounds):
            inputs["augmented"] = self.sampler.augmented  # [B] bool
        return StepSamples(
            batch=round.batch,
            group_ids=group_ids,
            rewards=rewards,
            terms=terms,
            correct=correctness(round.scores),
            sequence_weights=weights,
            metrics=metrics,
            inputs=inputs,
        )

    def advantage_inputs(self, step: StepSamples, old_logp: Tensor | None, entropy: Tensor | None) -> dict[str, Tensor]:
        """`rewards` ([B], or [B, K] for a matrix estimator), `group_ids` and the inputs the estimator names, on CPU.
        π_old's `old_logp` and `entropy` [B, T] are None where no estimator input reads them (no π_old pass ran)."""
        mask = step.batch.completion_mask  # [B, T]
        lengths = mask.sum(1).float()  # [B]
        available = {
            "correctness": step.correct,  # [B]
            "lengths": lengths,  # [B]
            "entropy": entropy,  # [B, T]
            "mask": mask,  # [B, T]
            **step.inputs,
        }
        if old_logp is not None:
            available["mean_logp"] = (old_logp * mask).sum(1) / lengths.clamp(min=1)  # [B]
        inputs = {"rewards": step.terms if self.matrix else step.rewards, "group_ids": step.group_ids}
        return {**inputs, **{name: available[name].cpu() for name in self.advantage_input_names}}

    def weights(self, step: StepSamples, old_logp: Tensor | None) -> StepWeights:
        """Token weights [B, T] (TR-GRPO's, from π_old: the policy of the first inner update) and sequence weights
        [B] (the sampler's times the learned ones). `old_logp` is None where no π_old pass ran (no TR-GRPO)."""
        device = step.batch.completion_mask.device
        token = None
        for r in self.token_weights:
            factor = REGULARIZERS.get(r.name)(old_logp, **r.kwargs)  # [B, T]
            token = factor if token is None else token * factor
        sequence = None if step.sequence_weights is None else step.sequence_weights.to(device)  # [B]
        if isinstance(self.policy, PreferencePolicy):
            self.policy.set_step(self.rewards.on_verdict(step.terms, step.correct), step.group_ids)
        elif isinstance(self.policy, InfoPolicy):
            self.policy.set_step(step.inputs["augmented"])
        if self.learner is None:
            return StepWeights(token=token, sequence=sequence, learned=None)
        learned, context = self.learner.weights(step, device)  # [B]
        learned = learned if sequence is None else learned * sequence
        return StepWeights(token=token, sequence=learned.detach().requires_grad_(), learned=learned, context=context)

    def learn(self, weights: StepWeights) -> dict[str, float]:
        """One step of the learned weights' optimizer on dL/dw (left on `weights.sequence` by the update), averaged
        over ranks as DDP averages the policy's gradients; returns their values as metrics."""
        if weights.learned is None:
            return {}
        return self.learner.learn(weights.learned, weights.sequence.grad, weights.context)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the components: the learned weights and their optimizer (empty without)."""
        state = {} if self.learner is None else self.learner.state_dict()
        if self.reference is not None:
            state["pvpo"] = self.reference.state_dict()
        if isinstance(self.policy, PreferencePolicy):
            state["amir"] = self.policy.preference_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output; a checkpoint that lacks the learned weights this run has is an error."""
        if isinstance(self.policy, PreferencePolicy):
            if "amir" not in state:
                raise ValueError("the checkpoint holds no AMIR-GRPO λ (it was written by another preset)")
            self.policy.load_preference_state(state["amir"])
        if self.reference is not None:
            if "pvpo" not in state:
                raise ValueError("the checkpoint holds no PVPO reference values (it was written by another preset)")
            self.reference.load_state_dict(state["pvpo"])
        if self.learner is None:
            return
        if "learned" not in state:
            raise ValueError("the checkpoint holds no learned sequence weights (it was written by another preset)")
        self.learner.load_state_dict(state)

    # --------------------------------------------------------------------------------------------- construction
    def _policy_terms(
        self, regularizers: tuple[ComponentConfig, ...], problems: list[str]
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The hyperparameters of AMIR-GRPO's and Info-GRPO's terms, which the policy's forward adds: one at most,
        and Info-GRPO's own sampler in place of any other."""
        terms = {r.name: r.kwargs for r in regularizers if r.name in POLICY_TERMS}
        if "amir" in terms and amir_problems(self.config):
            problems.append("regularizer 'amir': needs " + "; ".join(amir_problems(self.config)))
        if "info_grpo" in terms:
            reasons = info_problems(self.config, self.task)
            if self.sampler is not single_round or len(terms) > 1:
                reasons.append("no other sampler and no other policy term")
            if reasons:
                problems.append("regularizer 'info_grpo': needs " + "; ".join(reasons))
        return terms.get("amir"), terms.get("info_grpo")

    def _sampler(self, sampling: ComponentConfig | None, problems: list[str]) -> Sampler:
        if sampling is None or sampling.name == "daro_buckets":  # DARO's bins: its learner's, on one round
            return single_round
        if sampling.name == "pvpo_filter":
            return self.pvpo_filter or single_round
        if sampling.name not in SAMPLERS:
            problems.append(f"sampler {sampling.name!r}: {UNSUPPORTED.get(sampling.name, 'unknown to the trainer')}")
        elif self.parallel.world_size > 1 and sampling.name not in GLOBAL_SAMPLERS:
            problems.append(
                f"sampler {sampling.name!r}: not under data parallelism (its groups end up of different sizes, which "
                "do not split evenly over the ranks)"
            )
        else:
            return SAMPLERS[sampling.name](self.config, **sampling.kwargs)
        return single_round


class _Rounds:
    """The `Source` of the samplers: the trainer's prompt stream, rollout engine, task and reward pipeline."""

    def __init__(self, components: PresetComponents, prompts: PromptStream, rollout: Rollout) -> None:
        self.components, self.prompts, self.rollout = components, prompts, rollout
        self.num_generations = components.config.num_generations
        self.parallel = components.parallel  # a global sampler gathers the ranks' rounds (samplers.GLOBAL_SAMPLERS)

    def draw(self) -> list[Prompt]:
        """The same draw on every rank; each keeps its share."""
        count = self.components.config.prompts_per_step
        return self.prompts.next(count)[local_rows(count, self.components.parallel)]

    def generate(self, prompts: list[Prompt], num_generations: int) -> Round:
        tic = time.perf_counter()
        batch = self.rollout.generate([p.text for p in prompts], num_generations)
        self.components.generation_seconds += time.perf_counter() - tic
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
    """The verifier's verdict [B] bool: the task's `RewardBatch.correct` (its `answer` column, 1.0 / 0.0)."""
    return scores.verdict  # [B]

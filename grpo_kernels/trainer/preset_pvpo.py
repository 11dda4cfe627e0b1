"""PVPO's reference anchor (arXiv:2508.21104, spec §13): reference-policy pre-rollouts cached per prompt, the
static value baseline they give, and the `pvpo_filter` sampler (drop trivial prompts, inject a ground truth).

`ReferenceValues` rolls out the trainer's reference model (the initial policy, `ref_model`) M = G times on each
prompt the first time the prompt is drawn, scores those rollouts with the task and the preset's reward pipeline, and
caches V̂(q) = their mean reward and their accuracy (the task's verdicts) per prompt text for the rest of the run;
the cache is in the checkpoint, so a resumed run does not roll them out again. (The paper pre-rolls the whole
training set before training and refreshes it every few steps; a generated task has no finite training set, so the
cache fills as prompts are first seen, and no refresh interval is given by the preset: entries are never refreshed.)

`PVPOFilter` is the sampler: prompts with reference accuracy 1 are dropped and replaced by fresh draws (the paper
removes them from the training set); in a group whose prompt has reference accuracy 0 the last rollout is replaced
by the ground-truth trajectory, the prompt's reference answer (addition: the sum; GSM8K: the dataset's worked
solution; JSONL: its answer), which the task's verifier must accept. The paper takes it from a larger LLM. Its
sampling log-probs are the policy's own teacher-forced ones, so the sampler correction sees it as on-policy (how the
paper's ratio treats it is unverified).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from grpo_kernels.integrations.hf import policy_logprobs
from grpo_kernels.sampling import pvpo_filter
from grpo_kernels.trainer.rollout import HFRollout, RolloutBatch
from grpo_kernels.trainer.samplers import Collected, Round, Source
from grpo_kernels.trainer.tasks import AdditionTask, DatasetTask, Prompt, RewardBatch, Task

GROUND_TRUTH_TASKS = (AdditionTask, DatasetTask)  # the prompt's answer field is a completion the verifier accepts
MAX_DRAWS = 64  # draws of prompts before PVPOFilter gives up finding non-trivial ones


def ground_truth_problem(task: Task) -> str | None:
    """Why `task` has no ground-truth trajectory to inject, or None."""
    if isinstance(task, GROUND_TRUTH_TASKS):
        return None
    return (
        f"PVPO's ground-truth trajectories: task {task.name!r}'s answer field is what its verifier reads, not a "
        "solution the policy could have written"
    )


class ReferenceValues:
    """V̂(q) and the reference accuracy per prompt text, from M reference-policy rollouts made on first sight."""

    def __init__(self, task: Task, rewards: Callable[[Round], Tensor], num_rollouts: int) -> None:
        self.task, self.rewards, self.num_rollouts = task, rewards, num_rollouts
        self.cache: dict[str, tuple[float, float]] = {}  # prompt text -> (value, accuracy)
        self.rollout: HFRollout | None = None
        self.computed = 0  # prompts rolled out by the reference policy in this process (metric, tests)

    def bind(
        self, ref_model: nn.Module, tokenizer: Any, max_completion_length: int, temperature: float, **truncation: Any
    ) -> None:
        """Sample the reference policy as the policy is sampled: `temperature` and the `truncation` (top_k, top_p,
        min_p) of `HFRollout`."""
        self.rollout = HFRollout(ref_model, tokenizer, max_completion_length, temperature, **truncation)

    def ensure(self, prompts: list[Prompt]) -> None:
        """Roll out the reference policy on the prompts not cached yet (one batch) and cache their values."""
        new = list({p.text: p for p in prompts if p.text not in self.cache}.values())
        if not new:
            return
        if self.rollout is None:
            raise ValueError("PVPO: no reference policy bound yet (PresetComponents.bind_policy)")
        batch = self.rollout.generate([p.text for p in new], self.num_rollouts)
        answers = [new[i].answer for i in batch.group_ids.tolist()]
        round = Round(new, batch, self.task.score(batch.completions, answers, batch.truncated))
        rewards = self.rewards(round).double().cpu()  # [M·P]
        selection = pvpo_filter(round.scores.verdict.cpu(), batch.group_ids.cpu())
        values = torch.zeros(len(new), dtype=torch.float64).index_add(0, batch.group_ids.cpu(), rewards)  # [P]
        values /= torch.bincount(batch.group_ids.cpu(), minlength=len(new))
        for p, value, accuracy in zip(new, values.tolist(), selection.accuracy.tolist(), strict=True):
            self.cache[p.text] = (value, accuracy)
        self.computed += len(new)

    def values(self, round: Round) -> Tensor:
        """V̂(q) of each row's prompt [B] float32."""
        self.ensure(round.prompts)
        return torch.tensor([self.cache[round.prompts[g].text][0] for g in round.batch.group_ids.tolist()])

    def accuracy(self, prompt: Prompt) -> float:
        return self.cache[prompt.text][1]

    def state_dict(self) -> dict:
        return {"cache": dict(self.cache)}

    def load_state_dict(self, state: dict) -> None:
        self.cache = dict(state["cache"])


class PVPOFilter:
    """The `pvpo_filter` sampler: draws until the step's prompts are non-trivial for the reference policy, rolls
    them out, and injects the ground truth into groups the reference policy never solves (a ground truth longer
    than the generation budget is not injected, and counted)."""

    def __init__(self, reference: ReferenceValues, task: Task, temperature: float) -> None:
        self.reference, self.task, self.temperature = reference, task, temperature
        self.model: nn.Module | None = None
        self.tokenizer: Any = None
        self.max_length = 0

    def bind(self, model: nn.Module, tokenizer: Any, max_completion_length: int) -> None:
        self.model, self.tokenizer, self.max_length = model, tokenizer, max_completion_length

    def tokens(self, text: str) -> list[int]:
        """A ground truth's completion ids: its tokens and `<eos>`."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def __call__(self, source: Source) -> Collected:
        prompts: list[Prompt] = []
        wanted = draws = dropped = 0
        while not wanted or len(prompts) < wanted:
            if draws == MAX_DRAWS:
                raise ValueError(
                    f"PVPO: {MAX_DRAWS} draws found {len(prompts)} of {wanted} prompts the reference "
                    "policy does not always solve; the task is too easy for PVPO's filter"
                )
            drawn = source.draw()
            wanted, draws = wanted or len(drawn), draws + 1
            self.reference.ensure(drawn)
            kept = [p for p in drawn if self.reference.accuracy(p) < 1.0]
            dropped += len(drawn) - len(kept)
            prompts += kept[: wanted - len(prompts)]
        round = source.generate(prompts, source.num_generations)
        unsolved = [g for g, p in enumerate(prompts) if self.reference.accuracy(p) == 0.0]
        inject = [g for g in unsolved if len(self.tokens(prompts[g].answer)) <= self.max_length]  # within budget
        if inject:
            round = self.inject(round, inject)
        metrics = {
            "pvpo/prompts_dropped": float(dropped),
            "pvpo/ground_truth_injected": float(len(inject)),
            "pvpo/ground_truth_too_long": float(len(unsolved) - len(inject)),
        }
        return Collected(round, None, metrics)

    def inject(self, round: Round, groups: list[int]) -> Round:
        """`round` with the last rollout of each group in `groups` replaced by its prompt's ground truth."""
        batch = round.batch
        rows = [int((batch.group_ids == g).nonzero()[-1]) for g in groups]
        truths = [round.prompts[g].answer for g in groups]
        ids = [self.tokens(t) for t in truths]
        width = max([batch.completion_ids.shape[1], *map(len, ids)])
        completion_ids = _pad(batch.completion_ids, width, self.tokenizer.pad_token_id)  # [B, T']
        mask = _pad(batch.completion_mask, width, False)  # [B, T']
        completions, truncated = list(batch.completions), batch.truncated.clone()
        for row, tokens, text in zip(rows, ids, truths, strict=True):
            completion_ids[row] = self.tokenizer.pad_token_id
            completion_ids[row, : len(tokens)] = torch.tensor(tokens, device=completion_ids.device)
            mask[row] = torch.arange(width, device=mask.device) < len(tokens)
            completions[row], truncated[row] = text, False
        fields = {**vars(batch), "completion_ids": completion_ids, "completion_mask": mask}
        fields.update(completions=completions, truncated=truncated, sampling_logp=_pad(batch.sampling_logp, width, 0.0))
        batch = RolloutBatch(**fields)
        index = torch.tensor(rows, device=mask.device)
        logp = policy_logprobs(
            self.model, batch.input_ids[index], batch.attention_mask[index], mask[index], temperature=self.temperature
        )  # [n, T'] the policy's own log-probs of the ground truth
        batch.sampling_logp[index] = logp.detach().to(batch.sampling_logp.dtype)
        scores = self.task.score(batch.completions, round.answers, batch.truncated)
        _check_accepted(scores, rows, truths)
        return Round(round.prompts, batch, scores)


def _pad(x: Tensor, width: int, value: Any) -> Tensor:
    """`x` [B, T] right-padded with `value` to [B, width]."""
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def _check_accepted(scores: RewardBatch, rows: list[int], truths: list[str]) -> None:
    rejected = [t for row, t in zip(rows, truths, strict=True) if not bool(scores.verdict[row])]
    if rejected:
        raise ValueError(f"PVPO: the task's verifier rejects the ground truth {rejected[0][:80]!r} it would inject")


def build_pvpo(
    config: Any, task: Task, world_size: int, rewards: Callable[[Round], Tensor], filtering: bool, problems: list[str]
) -> tuple[ReferenceValues | None, PVPOFilter | None]:
    """PVPO's reference values (advantage `pvpo` or sampler `pvpo_filter`) and its filter (the sampler), or Nones
    after a problem: the reference policy is the trainer's reference model (beta != 0), one process only (the
    filter's extra draws would move the ranks' prompt streams apart), and the filter needs a ground truth."""
    reasons = []
    if config.loss.beta == 0.0:
        reasons.append("its reference policy is the trainer's reference model, which exists only with beta != 0")
    if world_size > 1:
        reasons.append(
            "not under data parallelism (prompts dropped per rank would move the ranks' prompt streams apart)"
        )
    if filtering and ground_truth_problem(task):
        reasons.append(ground_truth_problem(task))
    if reasons:
        problems.append("PVPO's reference pre-rollouts: " + "; ".join(reasons))
        return None, None
    reference = ReferenceValues(task, rewards, config.num_generations)
    return reference, PVPOFilter(reference, task, config.loss.temperature) if filtering else None

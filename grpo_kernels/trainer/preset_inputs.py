"""The per-step inputs some papers' rewards need, produced from the task or the policy, or the reason they cannot be.

A paper's reward may need more than a verdict: GAPO an answer key and the valid answers, SPO a correct-prefix score
(RTS), RankGRPO a listwise rank, P-GRPO a reasoning reward, DRA-GRPO a sentence embedding. `RewardInputs(task)` holds
the producers; `reason(name)` says, before any model work, why the task cannot give one (None: it can), and
`__call__(round, names)` gives them for one generation round. Nothing here is a judge or a reward model: an input
with no honest source on the task stays a refusal.

- `answer_keys`, `valid_answers` (GAPO): on a task with one accepted answer per prompt (addition, GSM8K, JSONL) the
  valid set is that answer (L = 1) and a completion's key is it when the verifier accepts the completion, its own
  stripped text otherwise, so the reward is ±1 by the verdict (GAPO's frequency term needs L > 1 to act). Countdown
  accepts many equations per problem and enumerates none: refused.
- `rts` (SPO): the fraction of the stripped completion before its first character that leaves the reference answer,
  on tasks whose reference answer is the exact expected completion (addition). Elsewhere a step-wise judge is needed.
- `ranks` (RankGRPO): 1 + the number of the group's completions with a larger graded task reward (the task's weighted
  sum of its columns: answer, closeness, format), so ties share a rank; `correct` is the rule reward s ∈ {0, 1}.
- `format_rewards`, `outcome_rewards` (P-GRPO): the task's `format` column and its verdict; `think_rewards` has no
  source (no reasoning span, no reasoning reward model).
- `embed` (DRA-GRPO): `PolicyEmbedder`, the masked mean of the policy's final hidden states over the completion's
  tokens (no gradient), in place of the paper's external sentence encoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from grpo_kernels.groups import group_index
from grpo_kernels.trainer.samplers import Round
from grpo_kernels.trainer.tasks import AdditionTask, DatasetTask, RewardBatch, Task

EXACT_COMPLETION_TASKS = (AdditionTask,)  # the reference answer is the expected completion, character for character
SINGLE_ANSWER_TASKS = (AdditionTask, DatasetTask)  # one accepted answer per prompt
NO_SOURCE = {  # inputs no shipped task or model gives
    "think_rewards": "a reasoning reward model's score of the completion's thinking span: no shipped task has a "
    "thinking span and no reasoning reward model ships with the trainer",
}


def verdict(scores: RewardBatch) -> Tensor:
    """The verifier's 0/1 verdict [B] bool (`RewardBatch.verdict`)."""
    return scores.verdict.cpu()  # [B]


def answer_keys(round: Round) -> tuple[list[str], list[tuple[str, ...]]]:
    """GAPO's (answer key per completion, valid answers of its prompt) on a single-answer task (L = 1)."""
    answers = round.answers
    correct = verdict(round.scores).tolist()
    keys = [a if ok else c.strip() for c, a, ok in zip(round.batch.completions, answers, correct, strict=True)]
    return keys, [(a,) for a in answers]


def correct_prefix_scores(completions: list[str], answers: list[str]) -> Tensor:
    """SPO's RTS [B] float32: the fraction of each stripped completion before its first character that differs from
    the reference answer (1 for the answer itself, 0 for an empty completion)."""
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        text = completion.strip()
        prefix = 0
        while prefix < min(len(text), len(answer)) and text[prefix] == answer[prefix]:
            prefix += 1
        scores.append(prefix / len(text) if text else 0.0)
    return torch.tensor(scores, dtype=torch.float32)  # [B]


def group_ranks(scores: Tensor, group_ids: Tensor) -> Tensor:
    """1-based rank [B] long of each score within its group, best first; ties share the best rank (1, 2, 2, 4)."""
    index = group_index(group_ids.cpu(), len(scores))  # [B]
    same = index[:, None] == index[None, :]  # [B, B]
    return 1 + (same & (scores[None, :] > scores[:, None])).sum(1)  # [B]


class PolicyEmbedder:
    """DRA-GRPO's `embed`: texts -> the masked mean of the policy's final hidden states over their tokens [B, H].

    The paper encodes each completion with an external sentence encoder (jina-embeddings-v2-small-en); this one is the
    policy's own decoder, run without gradient on the completion text alone. `bind` gives it the model and tokenizer
    (the trainer does, once they exist); calling it before is a ValueError.
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.tokenizer: Any = None

    def bind(self, model: nn.Module, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> Tensor:
        if self.model is None:
            raise ValueError("PolicyEmbedder: no policy bound yet (PresetComponents.bind_policy)")
        device = next(self.model.parameters()).device
        encoded = self.tokenizer(list(texts), return_tensors="pt", padding=True).to(device)
        mask = encoded["attention_mask"].float()  # [B, L]
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], use_cache=False)
        hidden = hidden.last_hidden_state.float()  # [B, L, H]
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)  # [B, H]


class RewardInputs:
    """The reward inputs this module produces, for one task; `reason` says why one cannot be given on it."""

    def __init__(self, task: Task, parallel_mode: str = "none") -> None:
        self.task, self.parallel_mode = task, parallel_mode
        self.embedder = PolicyEmbedder()
        self.producers: dict[str, Callable[[Round], Any]] = {
            "answer_keys": lambda r: answer_keys(r)[0],
            "valid_answers": lambda r: answer_keys(r)[1],
            "rts": lambda r: correct_prefix_scores(r.batch.completions, list(r.answers)),
            "ranks": lambda r: group_ranks(r.scores.rewards.cpu(), r.batch.group_ids),
            "format_rewards": lambda r: r.scores.columns[:, r.scores.names.index("format")].float().cpu(),
            "outcome_rewards": lambda r: verdict(r.scores).float(),
        }
        self.constructors: dict[str, Any] = {"embed": self.embedder}

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.producers, *NO_SOURCE)

    def reason(self, name: str) -> str | None:
        """Why `name` cannot be produced on this task, or None when it can."""
        task = self.task
        if name in NO_SOURCE:
            return NO_SOURCE[name]
        if name == "embed" and self.parallel_mode == "fsdp":
            return "the policy's hidden states outside its FSDP2 forward (sharded parameters): use --parallel ddp"
        if name in ("answer_keys", "valid_answers") and not isinstance(task, SINGLE_ANSWER_TASKS):
            return (
                f"GAPO's answer keys and valid-answer sets: task {task.name!r} may accept many answers per prompt "
                "and enumerates none (no canonical key, no valid set)"
            )
        if name == "rts" and not isinstance(task, EXACT_COMPLETION_TASKS):
            return (
                f"SPO's correct-prefix score (RTS): task {task.name!r} has no reference completion to check a prefix "
                "against, only a final answer; a step-wise judge model would be needed"
            )
        if name == "format_rewards" and "format" not in task.reward_names:
            return f"P-GRPO's format reward: task {task.name!r} has no 'format' column ({task.reward_names})"
        return None

    def __call__(self, round: Round, names: list[str]) -> dict[str, Any]:
        """The inputs `names` (among `producers`) for this round."""
        return {name: self.producers[name](round) for name in names}

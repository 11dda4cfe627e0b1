"""What a task hands the trainer: prompts with their answers, scored completions, and a resumable prompt stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from grpo_kernels.groups import group_index, group_varies
from grpo_kernels.rewards import MultiReward
from grpo_kernels.rewards.limits import over_limit_rows

EVAL_SIZE = 256  # held-out prompts evaluated when no size is given (TrainConfig.eval_size's default)
VERDICT = "answer"  # every task's verifier column: 1.0 right, 0.0 wrong; `RewardBatch.correct` is its verdict


@dataclass(frozen=True)
class Prompt:
    """One prompt and the answer a verifier accepts (for some tasks: what the verifier needs, e.g. JSON)."""

    text: str
    answer: str
    source: str = field(default="", compare=False)  # where it was read ("file, line N"), for errors; "" generated


@dataclass(frozen=True)
class RewardBatch:
    """Per-completion rewards [B] (the weighted sum, shaped), the reward columns [B, K] they came from, which
    completions went over a reward's size or time limit [B] (scored 0 there; see grpo_kernels.rewards.limits), and
    the task's 0/1 verdict [B] (`correct`: the answer is right), which correctness-based components read instead of
    the shaped reward (DAPO's filter, GPG's valid groups, pass rates)."""

    rewards: Tensor  # [B]
    columns: Tensor  # [B, K]
    names: tuple[str, ...]
    over_limit: Tensor | None = None  # [B] bool
    correct: Tensor | None = None  # [B] bool; None (a batch built by hand): the `answer` column, `verdict`

    @property
    def verdict(self) -> Tensor:
        """[B] bool: `correct`, or for a batch without it its `answer` column (1.0 / 0.0) above 0.5."""
        if self.correct is not None:
            return self.correct
        if "answer" not in self.names:
            raise ValueError(f"this reward batch has no verdict: no `correct` and no 'answer' column in {self.names}")
        return self.columns[:, self.names.index("answer")] > 0.5  # [B]

    def select(self, rows: Tensor) -> RewardBatch:
        """The rows `rows` (indices [b]), in that order."""
        over_limit = None if self.over_limit is None else self.over_limit[rows.cpu()]  # [b]
        correct = None if self.correct is None else self.correct[rows.cpu()]  # [b]
        return RewardBatch(self.rewards[rows], self.columns[rows], self.names, over_limit, correct)

    @staticmethod
    def cat(batches: Sequence[RewardBatch]) -> RewardBatch:
        """The batches' rows in order (`over_limit` and `correct` only when every batch has them)."""
        flags, verdicts = [b.over_limit for b in batches], [b.correct for b in batches]
        over_limit = None if any(f is None for f in flags) else torch.cat(flags)  # [B]
        correct = None if any(v is None for v in verdicts) else torch.cat(verdicts)  # [B]
        rewards = torch.cat([b.rewards for b in batches])  # [B]
        return RewardBatch(rewards, torch.cat([b.columns for b in batches]), batches[0].names, over_limit, correct)

    def metrics(self, group_ids: Tensor | None = None) -> dict[str, float]:
        """Means of the reward and of each column; with `group_ids` [B] also the fraction of completions whose group
        has all-equal rewards (`frac_reward_zero_std`: they get zero advantages, no learning signal). The trainer
        logs `over_limit`'s count next to these as `rewards/over_limit`."""
        out = {"reward": self.rewards.mean().item(), "reward_std": self.rewards.std().item()}
        out.update({f"rewards/{name}": self.columns[:, k].mean().item() for k, name in enumerate(self.names)})
        if group_ids is not None:
            index = group_index(group_ids.cpu(), len(self.rewards))  # [B]
            out["frac_reward_zero_std"] = 1.0 - group_varies(self.rewards, index).float().mean().item()
        return out


def score_columns(reward_fn: MultiReward, names: tuple[str, ...], completions: list[str], **kwargs) -> RewardBatch:
    """A task's scores: `reward_fn` (a `MultiReward`) on the completions, its weighted sum, the completions that went
    over a reward's limit (`limits.over_limit_rows`) and the verdict, the task's verifier column `answer` (exactly
    1.0 or 0.0) as bool. A completion over any reward's limit scores 0 in every column (its format, say, earns nothing
    either) and is wrong."""
    with over_limit_rows() as rows:
        columns = reward_fn(completions, **kwargs)  # [B, K]
    over_limit = torch.zeros(len(completions), dtype=torch.bool)  # [B]
    over_limit[sorted(rows)] = True
    columns = columns.masked_fill(over_limit[:, None].to(columns.device), 0.0)  # [B, K]
    answer = columns[:, names.index(VERDICT)]  # [B]
    if not ((answer == 0.0) | (answer == 1.0)).all():
        raise ValueError(f"the task's {VERDICT!r} column must be 0 or 1 (its verdict), got {answer.unique().tolist()}")
    return RewardBatch(columns @ reward_fn.weights, columns, names, over_limit, answer.cpu() == 1.0)


class Task(Protocol):
    """The trainer's view of a task. `reward_names[0]` is `"answer"`: 1.0/0.0 exact correctness (the accuracy); its
    scores (`score`) carry the verdict beside the shaped reward (`RewardBatch.correct`)."""

    name: str
    reward_names: tuple[str, ...]
    max_completion_length: int  # the generation budget in tokens when the trainer's config sets none

    @property
    def alphabet(self) -> str:
        """Every character the prompts and answers use (the tiny demo tokenizer's vocabulary)."""
        ...

    @property
    def max_prompt_length(self) -> int:
        """The longest prompt in tiny-tokenizer tokens, `<bos>` included."""
        ...

    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """n training prompts drawn with `generator` (its state is the data position)."""
        ...

    def eval_prompts(self) -> list[Prompt]:
        """Held-out prompts, the same at every call, disjoint from what `sample` draws where the task allows."""
        ...

    def score(self, completions: list[str], answers: Sequence[str], truncated: Tensor) -> RewardBatch:
        """Rewards of completions [B] given their prompts' answers and `truncated` [B] (no `<eos>`)."""
        ...


class PromptStream:
    """The task's prompts, drawn by a generator of their own: its state is the data position in a checkpoint."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, n: int) -> list[Prompt]:
        return self.task.sample(n, self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

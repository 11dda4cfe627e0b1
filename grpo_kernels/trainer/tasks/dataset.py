"""A task over a fixed list of prompts with a train and a test split (GSM8K, a local JSONL file).

Training draws prompts uniformly with replacement from the train split (one `randint` per batch, so the generator
state is the data position); evaluation uses the first `eval_size` prompts of the test split. Train prompts whose
text is also a test prompt are dropped, so the two never overlap. The reward has two columns, combined by
`REWARDS["gdpo_multi"]`: r = 0.9 · answer + 0.1 · format, with `answer` the task's 1/0 verifier and `format` 1 when
the completion has an answer of the expected shape and ended with `<eos>`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grpo_kernels.rewards import REWARDS
from grpo_kernels.trainer.tasks.records import EVAL_SIZE, Prompt, RewardBatch, score_columns

TextReward = Callable[..., Tensor]  # fn(completions, answers=..., truncated=...) -> [B] float32


class DatasetTask:
    """Prompts of a dataset's train split for training, the first `eval_size` of its test split for evaluation."""

    reward_names = ("answer", "format")
    reward_weights = (0.9, 0.1)

    def __init__(
        self,
        name: str,
        train: Sequence[Prompt],
        test: Sequence[Prompt],
        answer_reward: TextReward,
        format_reward: TextReward,
        eval_size: int = EVAL_SIZE,
        max_completion_length: int = 256,
    ) -> None:
        if eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {eval_size}")
        held_out = {p.text for p in test}
        self.name = name
        self.train = [p for p in train if p.text not in held_out]
        self.test = list(test)
        if not self.train or not self.test:
            raise ValueError(
                f"{name}: needs at least one train and one test prompt (after removing train prompts that are also "
                f"test prompts), got {len(self.train)} train and {len(self.test)} test"
            )
        self.eval_size = eval_size
        self.max_completion_length = max_completion_length  # the generation budget when the config sets none
        texts = [p.text + p.answer for p in (*self.train, *self.test)]
        self._alphabet = "".join(sorted(set("".join(texts))))
        self._max_prompt_length = max(len(p.text) for p in (*self.train, *self.test)) + 1  # + <bos>
        self.reward_fn = REWARDS.get("gdpo_multi")([answer_reward, format_reward], self.reward_weights)

    @property
    def alphabet(self) -> str:
        """Every character of the prompts and answers of both splits."""
        return self._alphabet

    @property
    def max_prompt_length(self) -> int:
        return self._max_prompt_length

    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """n train prompts, uniformly with replacement."""
        index = torch.randint(len(self.train), (n,), generator=generator)  # [n]
        return [self.train[i] for i in index.tolist()]

    def eval_prompts(self) -> list[Prompt]:
        """The first `eval_size` prompts of the test split."""
        return self.test[: self.eval_size]

    def score(self, completions: list[str], answers: Sequence[str], truncated: Tensor) -> RewardBatch:
        return score_columns(self.reward_fn, self.reward_names, completions, answers=list(answers), truncated=truncated)

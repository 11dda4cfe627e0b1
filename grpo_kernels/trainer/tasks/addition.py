"""`addition`, the CPU demo's generated task: prompts `"a+b="` with single-digit operands and a + b <= `max_sum`
(9 by default, so every answer is one digit: `"3+4="` -> `"7"`). The answer is drawn uniformly from 0..max_sum and
then the operands, so no constant answer beats chance (with operands drawn uniformly, "9" would be right 10 % of the
time: a trap a policy that has not yet learnt to read the prompt falls into). The reward is a weighted sum of three
text rewards, combined by the `REWARDS` registry's `gdpo_multi` (which keeps the columns for the metrics):

    r = 0.7 · answer + 0.2 · closeness + 0.1 · format,   r ∈ [0, 1]

`answer` is 1 for exactly the sum (its mean is the accuracy); `closeness` = max(0, 1 − |ŷ − y| / 10) for a number
ŷ, partial credit that makes the reward graded rather than all-or-nothing, so a group of G completions almost always
has a reward spread to learn from (with `answer` alone a policy from scratch mostly sees all-wrong groups, whose
advantages are 0); `format` is 1 when the completion is a number that ended with `<eos>`. r >= 0.8 needs about 72 %
exact answers (every completion well-formed, the others off by one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.limits import score_texts
from grpo_kernels.trainer.tasks.records import Prompt, RewardBatch, score_columns

_NUMBER = re.compile(r"\d+")


def exact_answer(completions: list[str], answers: Sequence[str], **kwargs) -> Tensor:
    """1.0 where the completion is exactly the answer (surrounding whitespace ignored), else 0.0. [B] float32."""
    completions = check_texts("completions", completions)
    return score_texts(lambda c, a: c.strip() == a, completions, answers)


def _closeness(completion: str, answer: str) -> float:
    text = completion.strip()
    if not _NUMBER.fullmatch(text):
        return 0.0
    digits = text.lstrip("0") or "0"
    if len(digits) > len(answer) + 1:  # ŷ >= 10^(len(answer) + 1) > y + 10: 0, without parsing ŷ
        return 0.0
    return max(0.0, 1.0 - abs(int(digits) - int(answer)) / 10.0)


def closeness(completions: list[str], answers: Sequence[str], **kwargs) -> Tensor:
    """max(0, 1 − |ŷ − y| / 10) where the completion is a number ŷ, else 0.0: partial credit. [B] float32."""
    completions = check_texts("completions", completions)
    return score_texts(_closeness, completions, answers)


def number_format(completions: list[str], truncated: Tensor, **kwargs) -> Tensor:
    """1.0 where the completion is only digits and ended with `<eos>` (not `truncated`), else 0.0. [B] float32."""
    completions = check_texts("completions", completions)
    digits = score_texts(lambda c: _NUMBER.fullmatch(c) is not None, completions).bool()  # [B]
    return (digits & ~truncated.cpu()).float()


class AdditionTask:
    """`"a+b="` -> `"a+b"` for single digits a, b with a + b <= max_sum; the answer is uniform over 0..max_sum."""

    name = "addition"
    reward_names = ("answer", "closeness", "format")
    reward_weights = (0.7, 0.2, 0.1)
    max_completion_length = 3  # the generation budget when the config sets none: a digit or two and <eos>

    def __init__(self, max_sum: int = 9) -> None:
        if not 0 <= max_sum <= 18:
            raise ValueError(f"max_sum must be in [0, 18] (single-digit operands), got {max_sum}")
        self.max_sum = max_sum
        self.reward_fn = REWARDS.get("gdpo_multi")([exact_answer, closeness, number_format], self.reward_weights)

    @property
    def alphabet(self) -> str:
        """Every character a prompt or an answer uses (the demo tokenizer's vocabulary)."""
        return "0123456789+="

    @property
    def max_prompt_length(self) -> int:
        return len("9+9=") + 1  # + <bos>

    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """n prompts: the sum uniform over 0..max_sum, then the first operand uniform over those that fit."""
        total = torch.randint(0, self.max_sum + 1, (n,), generator=generator)  # [n]
        low, high = (total - 9).clamp(min=0), total.clamp(max=9)  # [n] each: the first operand's range
        a = low + (torch.rand(n, generator=generator) * (high - low + 1)).long().clamp(max=high - low)  # [n]
        return [Prompt(f"{x}+{y - x}=", str(y)) for x, y in zip(a.tolist(), total.tolist(), strict=True)]

    def eval_prompts(self) -> list[Prompt]:
        """Every prompt of the task (55 for max_sum = 9): too few to hold some out, so training sees them too."""
        pairs = [(x, y) for x in range(10) for y in range(10) if x + y <= self.max_sum]
        return [Prompt(f"{x}+{y}=", str(x + y)) for x, y in pairs]

    def score(self, completions: list[str], answers: Sequence[str], truncated: Tensor) -> RewardBatch:
        return score_columns(self.reward_fn, self.reward_names, completions, answers=answers, truncated=truncated)

"""`countdown`: reach a target from 3–4 numbers with + − × ÷, each number used exactly once (generated, no download).

Prompt `"Using 3 7 25 reach 46:"`, completion an equation such as `"7*3+25"` (a model may also wrap it in
`<answer>…</answer>`; the tag's content is then the equation). A problem is built from a solution, so every prompt
is solvable: numbers drawn from 1..max_number, combined two at a time by an operator whose result is a positive
integer (`a − b` only when a > b, `a / b` only when b divides a) until one value is left, which is the target when it
lies in 1..max_target (else the draw is repeated). The prompt's answer field holds what the verifier needs,
`{"target": 46, "numbers": [3, 7, 25]}` (JSON). The reward, combined by `REWARDS["gdpo_multi"]`:

    r = 0.7 · answer + 0.2 · closeness + 0.1 · format

`answer` is `REWARDS["countdown"]` (the equation uses each number exactly once and equals the target);
`closeness` = max(0, 1 − |v − target| / 10) for an equation of value v that uses the numbers, partial credit;
`format` is 1 when the equation is only digits, `+ - * / ( )` and spaces, and ended with `<eos>`.

Held out: a problem whose prompt text hashes (CRC-32) to 0 mod 10 is an evaluation problem that `sample` never
draws; `eval_prompts` draws `eval_size` distinct ones from a fixed seed, the same set for every run.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.countdown import equation_value
from grpo_kernels.rewards.extraction import answer_tag
from grpo_kernels.rewards.limits import score_texts, too_long
from grpo_kernels.trainer.tasks.records import EVAL_SIZE, Prompt, RewardBatch, score_columns

EVAL_SEED = 1234  # the held-out set's generator: independent of the run's seed, so runs are compared on one set
EVAL_BUCKETS = 10  # one problem in EVAL_BUCKETS is held out
MAX_DRAWS_PER_EVAL_PROMPT = 100  # gives up when the problem space has too few distinct held-out problems
_EQUATION = re.compile(r"[\d+\-*/()\s]+")  # with at least one digit (_DIGIT); two linear scans
_DIGIT = re.compile(r"\d")
_EQUATION_CHARS = "0123456789+-*/() "


def _equation(completion: str) -> str:
    """The `<answer>` tag's content when there is one, else the whole completion."""
    tagged = answer_tag(completion)
    return completion if tagged is None else tagged


def _problems(answers: Sequence[str]) -> tuple[list[int], list[list[int]]]:
    """Targets and numbers from the prompts' JSON answer fields."""
    parsed = [json.loads(a) for a in answers]
    return [p["target"] for p in parsed], [p["numbers"] for p in parsed]


def countdown_answer(completions: list[str], answers: Sequence[str], **kwargs) -> Tensor:
    """`REWARDS["countdown"]` on the equation (tagged, or the whole completion). [B] float32."""
    completions = check_texts("completions", completions)
    targets, numbers = _problems(answers)
    tagged = [c if too_long(c) else f"<answer>{_equation(c)}</answer>" for c in completions]  # too long: counted there
    return REWARDS.get("countdown")(tagged, targets=targets, numbers=numbers)


def _closeness(completion: str, target: int, numbers: list[int]) -> float:
    value = equation_value(_equation(completion), numbers)
    return 0.0 if value is None else max(0.0, 1.0 - float(abs(value - Fraction(target))) / 10.0)


def countdown_closeness(completions: list[str], answers: Sequence[str], **kwargs) -> Tensor:
    """max(0, 1 − |v − target| / 10) where the equation uses each number once and has value v, else 0. [B] float32."""
    completions = check_texts("completions", completions)
    return score_texts(_closeness, completions, *_problems(answers))


def _well_formed(completion: str) -> bool:
    equation = _equation(completion)
    return _EQUATION.fullmatch(equation) is not None and _DIGIT.search(equation) is not None


def equation_format(completions: list[str], truncated: Tensor, **kwargs) -> Tensor:
    """1.0 where the equation is digits, `+ - * / ( )` and spaces and the completion ended with `<eos>`. [B] float32."""
    completions = check_texts("completions", completions)
    well_formed = score_texts(_well_formed, completions).bool()  # [B]
    return (well_formed & ~truncated.cpu()).float()


def is_held_out(text: str) -> bool:
    """Whether a prompt belongs to the evaluation set (a stable hash of its text, the same in every process)."""
    return zlib.crc32(text.encode()) % EVAL_BUCKETS == 0


class CountdownTask:
    """Countdown problems with a guaranteed solution; one in ten (by prompt hash) is held out for evaluation."""

    name = "countdown"
    reward_names = ("answer", "closeness", "format")
    reward_weights = (0.7, 0.2, 0.1)
    max_completion_length = 16  # the generation budget when the config sets none: an equation of 4 numbers

    def __init__(
        self,
        eval_size: int = EVAL_SIZE,
        min_count: int = 3,
        max_count: int = 4,
        max_number: int = 25,
        max_target: int = 99,
    ) -> None:
        if not 2 <= min_count <= max_count:
            raise ValueError(f"need 2 <= min_count <= max_count, got {min_count}, {max_count}")
        if eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {eval_size}")
        self.eval_size, self.min_count, self.max_count = eval_size, min_count, max_count
        self.max_number, self.max_target = max_number, max_target
        self.reward_fn = REWARDS.get("gdpo_multi")(
            [countdown_answer, countdown_closeness, equation_format], self.reward_weights
        )

    @property
    def alphabet(self) -> str:
        """The prompt's words and the equation's characters."""
        return "".join(sorted(set("Using reach:" + _EQUATION_CHARS)))

    @property
    def max_prompt_length(self) -> int:
        return len(self._text([self.max_number] * self.max_count, self.max_target)) + 1  # + <bos>

    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """n training problems (never a held-out one)."""
        prompts: list[Prompt] = []
        while len(prompts) < n:
            prompt = self._draw(generator)
            if not is_held_out(prompt.text):
                prompts.append(prompt)
        return prompts

    def eval_prompts(self) -> list[Prompt]:
        """`eval_size` distinct held-out problems from the fixed seed `EVAL_SEED`."""
        generator = torch.Generator().manual_seed(EVAL_SEED)
        prompts: dict[str, Prompt] = {}
        for _ in range(MAX_DRAWS_PER_EVAL_PROMPT * self.eval_size):
            prompt = self._draw(generator)
            if is_held_out(prompt.text):
                prompts.setdefault(prompt.text, prompt)
            if len(prompts) == self.eval_size:
                return list(prompts.values())
        raise ValueError(f"eval_size {self.eval_size} is more than the {len(prompts)} held-out problems found")

    def score(self, completions: list[str], answers: Sequence[str], truncated: Tensor) -> RewardBatch:
        return score_columns(self.reward_fn, self.reward_names, completions, answers=answers, truncated=truncated)

    def _draw(self, generator: torch.Generator) -> Prompt:
        """One problem: random numbers reduced pairwise by random exact operations to a target in 1..max_target."""
        while True:
            count = _randint(self.min_count, self.max_count, generator)
            numbers = sorted(_randint(1, self.max_number, generator) for _ in range(count))
            pool = list(numbers)
            while len(pool) > 1:
                a = pool.pop(_randint(0, len(pool) - 1, generator))
                b = pool.pop(_randint(0, len(pool) - 1, generator))
                results = [a + b, a * b]
                if a > b:
                    results.append(a - b)
                if b > 1 and a % b == 0:
                    results.append(a // b)
                pool.append(results[_randint(0, len(results) - 1, generator)])
            if 1 <= pool[0] <= self.max_target:
                target = pool[0]
                return Prompt(self._text(numbers, target), json.dumps({"target": target, "numbers": numbers}))

    @staticmethod
    def _text(numbers: Sequence[int], target: int) -> str:
        return f"Using {' '.join(map(str, numbers))} reach {target}:"


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """Uniform integer in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))

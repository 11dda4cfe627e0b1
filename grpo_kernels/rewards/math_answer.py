"""Verifiable math-answer reward: the completion's final answer checked against the ground truth by math-verify."""

from __future__ import annotations

import importlib.util
import itertools
import math
import re

import torch
from torch import Tensor

from grpo_kernels.checks import check_length, check_texts
from grpo_kernels.rewards import REWARDS, math_pool
from grpo_kernels.rewards.extraction import answer_tag, last_boxed
from grpo_kernels.rewards.limits import over_limit, too_long

TIMEOUT_SECONDS = 5.0  # per answer (math-verify's own default), enforced in any thread by killing the worker
MAX_ANSWER_CHARS = 10_000  # longest final answer handed to math-verify
MAX_EXPONENT = 100_000  # largest integer allowed in an exponent, and largest value of a literal power there
MAX_FACTORIAL = 100_000  # largest integer whose factorial an answer may ask for

_POWER = re.compile(r"\^|\*\*")
_INTEGER = re.compile(r"\d+")
_FACTORIAL = re.compile(r"(?<!\d)(\d+)\s*!")
_BARE_EXPONENT = re.compile(r"\s*(?:[-+]?\d+|\S?)")  # what `^` raises to without braces: a number or one character
_BRACKETS = {"{": "}", "(": ")"}


def final_answer(completion: str) -> str | None:
    """The last `\\boxed{}` inside the last `<answer>` tag, else the tag's content, else the last `\\boxed{}`."""
    tagged = answer_tag(completion)
    if tagged is None:
        return last_boxed(completion)
    return last_boxed(tagged) or tagged or None


def _over(digits: str, limit: int) -> bool:
    return len(digits) > len(str(limit)) or int(digits) > limit


def _closing(text: str) -> dict[int, int]:
    """Position of each `{` / `(` -> position of the bracket that closes it (one scan, a stack per kind)."""
    stacks: dict[str, list[int]] = {"{": [], "(": []}
    closes = {close: open_ for open_, close in _BRACKETS.items()}
    pairs = {}
    for at, char in enumerate(text):
        if char in stacks:
            stacks[char].append(at)
        elif char in closes and stacks[closes[char]]:
            pairs[stacks[closes[char]].pop()] = at
    return pairs


def _literal_before(text: str, at: int) -> str:
    """The integer literal that ends just before `at` (spaces skipped), or ""."""
    end = at
    while end > 0 and text[end - 1] == " ":
        end -= 1
    start = end
    while start > 0 and text[start - 1].isdecimal():
        start -= 1
    return text[start:end]


def too_big(expression: str) -> bool:
    """Whether an answer asks for a number too large to compute: the factorial of an integer over `MAX_FACTORIAL`
    (`10000000!`), an integer over `MAX_EXPONENT` anywhere in an exponent (`9^{99999999}`), or a literal power in an
    exponent whose value is over `MAX_EXPONENT` (`10^{10^{10}}`; `2^{2^{3}}` and `2^{2^{n}}` pass).

    A linear screen in front of the time limit, for the common shapes: it spares the worker a kill and a restart.
    Whatever it lets through is still stopped by `TIMEOUT_SECONDS`."""
    if any(_over(m[1], MAX_FACTORIAL) for m in _FACTORIAL.finditer(expression)):
        return True
    powers = list(_POWER.finditer(expression))
    if not powers:
        return False
    pairs = _closing(expression) if "{" in expression or "(" in expression else {}
    starts = [0] * (len(expression) + 1)  # +1 where an exponent starts, -1 where it ends
    exponents = []
    for power in powers:
        start = _BARE_EXPONENT.match(expression, power.end()).end()
        first = expression[start - 1 : start] if start > power.end() else ""
        if first in _BRACKETS:  # a braced exponent: up to its closing bracket
            start -= 1
            end = pairs.get(start, len(expression) - 1) + 1
        else:
            start, end = power.end(), start
        starts[start] += 1
        starts[end] -= 1
        exponents.append((power.start(), start, end))
    covered = list(itertools.accumulate(starts))  # > 0 inside an exponent
    if any(covered[m.start()] and _over(m[0], MAX_EXPONENT) for m in _INTEGER.finditer(expression)):
        return True
    for at, start, end in exponents:
        if not covered[at] or end - start > 16:  # a power not in an exponent, or no literal exponent
            continue
        base, exponent = _literal_before(expression, at), expression[start:end].strip("{}() ")
        if not (base and exponent.isdecimal()):
            continue
        digits = math.log10(max(int(base), 1)) if len(base) < 16 else len(base)  # log10(base), about
        if int(exponent) * digits > math.log10(MAX_EXPONENT):
            return True
    return False


def verify_answers(
    answers: list[str], predictions: list[str | None], timeout_seconds: float | None = None
) -> list[str]:
    """math-verify's verdict on each (gold answer, predicted final answer): "equal", "different", "bad_gold"
    (math-verify cannot parse the gold answer) or "over_limit": a prediction over `MAX_ANSWER_CHARS` or `too_big`,
    or a verification still running after `timeout_seconds` (default `TIMEOUT_SECONDS`), which is then killed.

    The gold answer is parsed as `\\boxed{answer}`, else as written (`$\\frac{1}{2}$`); the prediction as
    `\\boxed{prediction}`; None is a missing prediction ("different" once the gold parses). Runs in math_pool's
    worker processes, so the limit holds in any thread. Needs math-verify (the `math` extra)."""
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError("math_answer needs math-verify: pip install 'grpo-kernels[math]'")
    seconds = TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds
    if not seconds > 0:
        raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
    screened = [p is not None and (len(p) > MAX_ANSWER_CHARS or too_big(p)) for p in predictions]
    jobs = [
        {"gold": answer, "predicted": None if skip else predicted, "seconds": seconds}
        for answer, predicted, skip in zip(answers, predictions, screened, strict=True)
    ]
    results = math_pool.verdicts(jobs)
    return ["over_limit" if skip and v != "bad_gold" else v for v, skip in zip(results, screened, strict=True)]


@REWARDS.register("math_answer", paper="DeepSeek-R1 rule-based accuracy reward, arXiv:2501.12948")
def math_answer(
    completions: list[str], answers: list[str], *, timeout_seconds: float | None = None, **kwargs
) -> Tensor:
    """1.0 when the final answer (`\\boxed{}` or `<answer>` tag) is mathematically equal to `answers[i]`, else 0.0.

    The RLVR binary verifier reward (DeepSeek-R1, arXiv:2501.12948; spec §1): both sides are parsed by
    math-verify as `\\boxed{...}` (a gold answer also as written, e.g. `$\\frac{1}{2}$`) and compared with
    `verify(gold, prediction)`, so `0.5`, `\\frac12` and `50\\%` match. A completion with no extractable answer
    scores 0; a gold answer math-verify cannot parse is a ValueError. Bounded in any thread: a completion over
    `limits.MAX_COMPLETION_CHARS`, an answer over `MAX_ANSWER_CHARS` or `too_big`, or a verification past
    `timeout_seconds` (default `TIMEOUT_SECONDS`, per answer) scores 0 and is counted (`limits.over_limit_rows`).
    Extra keyword arguments are ignored.
    Needs the `math` extra: pip install 'grpo-kernels[math]'. Returns [B] float32.
    """
    completions = check_texts("completions", completions)
    answers = check_texts("answers", answers)
    check_length("answers", answers, len(completions))
    long = [too_long(c) for c in completions]
    predictions = [None if skip else final_answer(c) for c, skip in zip(completions, long, strict=True)]
    results = verify_answers(answers, predictions, timeout_seconds)
    if "bad_gold" in results:
        i = results.index("bad_gold")
        raise ValueError(f"answers[{i}] must be a math answer math-verify can parse, got {answers[i]!r}")
    scores = [
        over_limit(i) if skip or verdict == "over_limit" else float(verdict == "equal")
        for i, (verdict, skip) in enumerate(zip(results, long, strict=True))
    ]
    return torch.tensor(scores, dtype=torch.float32)

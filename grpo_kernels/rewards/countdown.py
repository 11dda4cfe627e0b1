"""Countdown reward: an arithmetic equation over the given numbers that reaches the target, checked without eval."""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from grpo_kernels.checks import check_length, check_texts, checked_floats
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.extraction import answer_tag
from grpo_kernels.rewards.limits import OverLimit, score_texts

TOLERANCE = 1e-6
# Longest equation evaluated, in characters (a Countdown equation over 3–6 numbers is ~10–40): a longer one is over
# the limit. With no power operator and each literal one of the given numbers (checked before parsing), this bounds
# the operand count, the operand size and the size of every intermediate fraction.
MAX_EQUATION_CHARS = 1_000
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = str.maketrans({"×": "*", "÷": "/", "−": "-"})
_ALLOWED = re.compile(r"[\d+\-*/()\s]+")  # decimal integers, the four operators, parentheses, whitespace
_LITERAL = re.compile(r"\d+")


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of a tree of + − × ÷ over integer literals."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    raise ValueError(f"not allowed in a Countdown equation: {type(node).__name__}")


def equation_value(equation: str, numbers: Sequence[int]) -> Fraction | None:
    """The exact value of `equation` if it is + − × ÷ and parentheses using each of `numbers` exactly once, else None.

    Raises `OverLimit` for an equation longer than `MAX_EQUATION_CHARS`. The literals are checked against `numbers`
    (as a multiset) before anything is parsed or evaluated, so only the given numbers are ever multiplied."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise OverLimit(f"equation of {len(equation)} characters, limit {MAX_EQUATION_CHARS}")
    equation = equation.translate(_SYMBOLS)
    if not _ALLOWED.fullmatch(equation):
        return None
    literals = _LITERAL.findall(equation)
    if len(literals) != len(numbers) or Counter(map(int, literals)) != Counter(numbers):
        return None
    try:
        return _evaluate(ast.parse(equation.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def _score(completion: str, target: float, numbers: list[int]) -> float:
    equation = answer_tag(completion)
    value = None if equation is None else equation_value(equation, numbers)
    return float(value is not None and abs(value - Fraction(target)) <= TOLERANCE)


@REWARDS.register("countdown", paper="Countdown task (Stream of Search, arXiv:2404.03683; TinyZero reward)")
def countdown(
    completions: list[str], targets: Tensor | Sequence[float], numbers: Tensor | Sequence[Sequence[int]], **kwargs
) -> Tensor:
    """1.0 when the `<answer>` equation uses each of `numbers[i]` exactly once and equals `targets[i]`, else 0.0.

    Countdown (Gandhi et al., arXiv:2404.03683; the TinyZero / nano-aha-moment RL reward): the content of the
    last `<answer>…</answer>` must be an expression of integer literals, + − × ÷ (ASCII or Unicode) and
    parentheses; its literals must equal `numbers[i]` as a multiset (no reuse, no number that was not given,
    none left out; no unary minus); evaluated exactly with fractions it must be within 1e-6 of the target.
    The expression is parsed with `ast` and walked, never `eval`ed: names, calls, attributes, powers, floats,
    `=` and division by zero score 0. A completion over `limits.MAX_COMPLETION_CHARS` or an equation over
    `MAX_EQUATION_CHARS` scores 0 and is counted (`limits.over_limit_rows`). Extra keyword arguments are ignored.
    Returns [B] float32.
    """
    completions = check_texts("completions", completions)
    n = len(completions)
    targets = checked_floats("targets", targets, (n,), dtype=torch.float64).tolist()
    check_length("numbers", numbers, n)
    rows = [row.tolist() if isinstance(row, Tensor) else list(row) for row in numbers]
    for i, row in enumerate(rows):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in row):
            raise TypeError(f"numbers[{i}] must hold integers, got {row}")
    return score_texts(_score, completions, targets, rows)

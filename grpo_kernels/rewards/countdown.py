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

TOLERANCE = 1e-6
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = str.maketrans({"×": "*", "÷": "/", "−": "-"})
_ALLOWED = re.compile(r"[\d+\-*/()\s]+")  # decimal integers, the four operators, parentheses, whitespace


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of a tree of + − × ÷ over integer literals; records the literals in `used`."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"not allowed in a Countdown equation: {type(node).__name__}")


def equation_value(equation: str, numbers: Sequence[int]) -> Fraction | None:
    """The exact value of `equation` if it is + − × ÷ and parentheses using each of `numbers` exactly once."""
    equation = equation.translate(_SYMBOLS)
    if not _ALLOWED.fullmatch(equation):
        return None
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(equation.strip(), mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    return value if Counter(used) == Counter(numbers) else None


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
    `=` and division by zero score 0. Extra keyword arguments are ignored. Returns [B] float32.
    """
    completions = check_texts("completions", completions)
    n = len(completions)
    targets = checked_floats("targets", targets, (n,), dtype=torch.float64).tolist()
    check_length("numbers", numbers, n)
    rows = [row.tolist() if isinstance(row, Tensor) else list(row) for row in numbers]
    for i, row in enumerate(rows):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in row):
            raise TypeError(f"numbers[{i}] must hold integers, got {row}")
    scores = []
    for completion, target, row in zip(completions, targets, rows, strict=True):
        equation = answer_tag(completion)
        value = None if equation is None else equation_value(equation, row)
        scores.append(float(value is not None and abs(value - Fraction(target)) <= TOLERANCE))
    return torch.tensor(scores, dtype=torch.float32)

"""Size and time limits of the text rewards, and the count of answers that went over them.

Model output is untrusted input: a reward reads at most `MAX_COMPLETION_CHARS` of a completion, extracts its answer
in one linear scan (extraction.py), bounds the arithmetic it evaluates (countdown.py) and verifies math in a worker
process it kills at the time limit (math_answer.py, math_pool.py). None of this uses signals, so every limit holds
in any thread. An answer over a limit scores 0 and is counted:

- `over_limit_rows()` collects, in this thread, the indices (within their reward call) of the completions that went
  over a limit; the tasks turn them into `RewardBatch.over_limit` and the trainer logs `rewards/over_limit`;
- `over_limit_count()` is the process-wide total, one per (reward call, completion), for callers with no task.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

# Longest completion a reward reads, in characters: ~25–33k tokens of text, above the generation budget of usual
# RLVR runs (DAPO: 20,480 tokens). Raise it for longer budgets; extraction stays linear in the length.
MAX_COMPLETION_CHARS = 100_000

_ROWS: ContextVar[set[int] | None] = ContextVar("over_limit_rows", default=None)
_LOCK = threading.Lock()
_COUNT = 0


class OverLimit(Exception):
    """An answer over a size or time limit: its reward scores it 0 and counts it (`over_limit`)."""


def over_limit(index: int) -> float:
    """Count completion `index` of the current reward call as over a limit; returns its score, 0.0."""
    global _COUNT
    with _LOCK:
        _COUNT += 1
    rows = _ROWS.get()
    if rows is not None:
        rows.add(index)
    return 0.0


def over_limit_count() -> int:
    """Answers scored over a limit since the process started (one per reward call and completion)."""
    return _COUNT


@contextmanager
def over_limit_rows() -> Iterator[set[int]]:
    """`with over_limit_rows() as rows: reward(completions, ...)` -> `rows`: the indices of the completions that
    went over a limit inside the block, in this thread (a set: a completion counts once over several rewards)."""
    rows: set[int] = set()
    token = _ROWS.set(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(token)


def too_long(text: str) -> bool:
    """Whether a completion is longer than `MAX_COMPLETION_CHARS` (read at call time, so it can be changed)."""
    return len(text) > MAX_COMPLETION_CHARS


def score_texts(score: Callable[..., float], completions: list[str], *columns: Sequence) -> Tensor:
    """`score(completion, *row)` for each completion and its row of `columns`, as [B] float32; a completion longer
    than `MAX_COMPLETION_CHARS`, or whose `score` raises `OverLimit`, scores 0.0 and is counted."""
    scores = []
    for i, (completion, *row) in enumerate(zip(completions, *columns, strict=True)):
        if too_long(completion):
            scores.append(over_limit(i))
            continue
        try:
            scores.append(float(score(completion, *row)))
        except OverLimit:
            scores.append(over_limit(i))
    return torch.tensor(scores, dtype=torch.float32)

"""One row per run from its metrics: final reward, steps to a reward threshold, greedy accuracy, tokens/s, peak memory;
the table as markdown and JSON.

The reward compared is the task's (`rewards/task` where a preset's own reward pipeline differs from it, else
`reward`), so that presets whose rewards add penalties or bonuses are measured on the same scale. It is the mean over
the batch trained on: after a sampler that filters groups (DAPO, GPG) that batch holds the kept groups only, so
greedy accuracy on the task's evaluation prompts is the unbiased column.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo_kernels.trainer import atomic_write

TASK_REWARD = "rewards/task"  # logged when a preset's step reward is not the task's reward
REWARD = "reward"
GREEDY_ACCURACY = "eval/answer"
INTERRUPTED = "interrupted"  # the error of a run an interrupt stopped (`compare --resume` continues it)


@dataclass(frozen=True)
class RunSummary:
    """What the table shows for one preset; `error` is set (and the numbers None) for a run that failed."""

    preset: str
    steps: int
    final_reward: float | None  # mean task reward over the last `window` steps
    steps_to_threshold: int | None  # first step whose `window`-step mean reward reaches the threshold; None: never
    greedy_accuracy: float | None  # exact-answer accuracy of greedy decoding on the task's eval prompts, last eval
    tokens_per_second: float | None  # completion tokens trained on per second of step time (eval steps excluded)
    seconds_per_step: float | None  # mean step time (eval steps excluded)
    peak_memory_mib: float | None  # the run process's peak RSS (CPU) or torch.cuda.max_memory_allocated (CUDA)
    wall_seconds: float | None  # the whole run, model build and evaluation included
    error: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, task reward) of every step


def task_reward(record: dict) -> float:
    """The task's reward of one step's record."""
    return float(record[TASK_REWARD] if TASK_REWARD in record else record[REWARD])


def smooth(values: list[float], window: int) -> list[float]:
    """The mean of each value with the `window - 1` before it (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window) : i + 1]) / min(window, i + 1) for i in range(len(values))]


def summarize(
    preset: str,
    history: list[dict],
    tokens: list[int],
    *,
    threshold: float,
    window: int,
    peak_memory_bytes: int,
    wall_seconds: float,
) -> RunSummary:
    """The row of one run from its per-step `history` (the trainer's metrics) and `tokens` (completion tokens trained
    on at each step; a resumed run's: at each of its last steps, those it ran)."""
    if len(tokens) > len(history):
        raise ValueError(f"tokens must have at most one entry per step ({len(history)}), got {len(tokens)}")
    timed = history[len(history) - len(tokens) :]  # a resumed run counts the tokens of its own steps
    curve = [(int(m["step"]), task_reward(m)) for m in history]
    rewards = [r for _, r in curve]
    means = smooth(rewards, window)
    reached = next((curve[i][0] for i, mean in enumerate(means) if i + 1 >= window and mean >= threshold), None)
    plain = [(n, m["step_time"]) for n, m in zip(tokens, timed, strict=True) if GREEDY_ACCURACY not in m]
    plain = plain or [(n, m["step_time"]) for n, m in zip(tokens, timed, strict=True)]
    seconds = sum(t for _, t in plain)
    evals = [m[GREEDY_ACCURACY] for m in history if GREEDY_ACCURACY in m]
    return RunSummary(
        preset=preset,
        steps=len(history),
        final_reward=means[-1] if means else None,
        steps_to_threshold=reached,
        greedy_accuracy=evals[-1] if evals else None,
        tokens_per_second=sum(n for n, _ in plain) / seconds if seconds > 0 else None,
        seconds_per_step=seconds / len(plain) if plain else None,
        peak_memory_mib=peak_memory_bytes / 2**20,
        wall_seconds=wall_seconds,
        curve=curve,
    )


def failed(preset: str, error: str) -> RunSummary:
    """The row of a run that stopped with an error."""
    return RunSummary(preset, 0, None, None, None, None, None, None, None, error=error)


COLUMNS = (  # (header, attribute, format)
    ("preset", "preset", "{}"),
    ("final reward", "final_reward", "{:.3f}"),
    ("steps to {threshold:g}", "steps_to_threshold", "{}"),
    ("greedy accuracy", "greedy_accuracy", "{:.3f}"),
    ("tokens/s", "tokens_per_second", "{:,.0f}"),
    ("s/step", "seconds_per_step", "{:.3f}"),
    ("peak memory (MiB)", "peak_memory_mib", "{:,.0f}"),
    ("wall (s)", "wall_seconds", "{:.0f}"),
)


def markdown_table(rows: list[RunSummary], threshold: float) -> str:
    """The table in GitHub markdown; a failed run's row says why; a threshold never reached is `—`."""
    headers = [h.format(threshold=threshold) for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    for row in rows:
        if row.error is not None:
            why = row.error if row.error == INTERRUPTED else f"failed: {row.error}"
            lines.append(f"| {row.preset} | {why} |" + " |" * (len(COLUMNS) - 2))
            continue
        cells = []
        for _, name, fmt in COLUMNS:
            value = getattr(row, name)
            cells.append("—" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, rows: list[RunSummary], setup: dict) -> None:
    """`{"setup": ..., "runs": [...]}`: every row with its reward curve, one line per run."""
    runs = ",\n  ".join(json.dumps(asdict(row)) for row in rows)
    atomic_write.write_text(path, f'{{"setup": {json.dumps(setup, indent=1)},\n "runs": [\n  {runs}\n ]\n}}\n')

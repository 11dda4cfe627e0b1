"""The numbers the docs quote, from one command: the demo's, measured from a finished run (the passage of
docs/trainer.md that holds them), and the performance numbers of README.md and docs/benchmarks.md, from the committed
result files under benchmarks/results/ (`benchmarks/result_numbers.py`).

    python -m grpo_kernels.train --output-dir runs/demo                  # the demo: 500 steps
    python -m benchmarks.documented_numbers runs/demo --write            # every passage (the demo's from runs/demo)
    python -m benchmarks.documented_numbers --write                      # the result files' passages only

The passage sits between `BEGIN` and `END` in docs/trainer.md (the README links to it); every reward, accuracy and
step of it comes from the run: its metrics.jsonl (task reward per step, greedy accuracy at each evaluation) and
`python -m grpo_kernels.evaluate` on its first and last checkpoints. tests/test_documented_runs.py runs the README's
demo line to completion and fails while the passage differs from what that run gives: when the trajectory changes,
the docs are regenerated with the two commands above; tests/test_result_numbers.py does the same for the result
files' passages. Without --write the passages are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

from benchmarks import result_numbers
from grpo_kernels.compare.report import smooth, task_reward

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "trainer.md"
BEGIN = "<!-- the demo's numbers: python -m benchmarks.documented_numbers RUN_DIR --write -->"
END = "<!-- end of the demo's numbers -->"
WINDOW = 20  # steps in the reward's moving mean
THRESHOLD = 0.8
LAST = 50  # steps of the final mean reward
ACCURACY = "eval/answer"  # exact-answer accuracy of greedy decoding (the trainer's evaluation)


def measure(run: Path) -> dict:
    """The demo's numbers from the run directory `run`."""
    from grpo_kernels import evaluate

    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [task_reward(m) for m in history]
    means = smooth(rewards, WINDOW)
    past = next((history[i]["step"] for i, m in enumerate(means) if i + 1 >= WINDOW and m >= THRESHOLD), None)
    evals = [(m["step"], m[ACCURACY]) for m in history if ACCURACY in m]
    with contextlib.redirect_stdout(io.StringIO()):  # its table
        results = evaluate.main(["--model", str(run / "checkpoints" / "step_000000"), "--compare", str(run)])
    return {
        "steps": history[-1]["step"],
        "first_mean_reward": sum(rewards[:WINDOW]) / min(WINDOW, len(rewards)),
        "past_threshold_at": past,
        "last_mean_reward": sum(rewards[-LAST:]) / min(LAST, len(rewards)),
        "first_eval": evals[0],
        "last_eval": evals[-1],
        "evaluate": (results["model"]["metrics"]["answer"], results["compare"]["metrics"]["answer"]),
    }


def passage(numbers: dict) -> str:
    """The sentences of docs/trainer.md that quote `numbers` (two decimals, as they are printed)."""
    past = numbers["past_threshold_at"]
    reached = f"past {THRESHOLD} at step {past}" if past is not None else f"without reaching {THRESHOLD}"
    (first_step, first), (last_step, last) = numbers["first_eval"], numbers["last_eval"]
    before, after = numbers["evaluate"]
    return (
        f"The run's numbers (from its metrics.jsonl and `evaluate`): the {WINDOW}-step mean reward goes from "
        f"{numbers['first_mean_reward']:.2f} {reached} and averages {numbers['last_mean_reward']:.2f} over the last "
        f"{LAST} steps; greedy accuracy on all 55 prompts is {first:.2f} at the first evaluation (step {first_step}) "
        f"and {last:.2f} at step {last_step}, and `evaluate` gives {before:.2f} → {after:.2f} (step 0 → step "
        f"{numbers['steps']})."
    )


def documented(page: Path = PAGE) -> str:
    """The passage as the page holds it now."""
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), page.read_text(encoding="utf-8"), re.S)
    if found is None:
        raise ValueError(f"{page} has no passage between {BEGIN!r} and {END!r}")
    return found.group(1)


def wrapped(text: str, width: int = 120) -> str:
    """`text` in lines of at most `width` characters, as the docs are written."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


def write(numbers: dict, page: Path = PAGE) -> None:
    text = page.read_text(encoding="utf-8")
    old = f"{BEGIN}\n{documented(page)}\n{END}"
    page.write_text(text.replace(old, f"{BEGIN}\n{wrapped(passage(numbers))}\n{END}"), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run", type=Path, nargs="?", help="the demo's run directory (python -m grpo_kernels.train --output-dir)"
    )
    parser.add_argument("--write", action="store_true", help="rewrite the passages in their pages")
    args = parser.parse_args(argv)
    if args.write:
        result_numbers.write_all()
    for result in result_numbers.PASSAGES:
        print(f"{result.page.relative_to(ROOT)}, {result.name}:\n{result_numbers.generated(result)}\n")
    if args.run is not None:
        numbers = measure(args.run)
        if args.write:
            write(numbers)
        print(wrapped(passage(numbers)))


if __name__ == "__main__":
    main()

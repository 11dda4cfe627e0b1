"""Tasks with verifiable answers: prompts, their answers, and the reward of a completion.

`build_task(config)` picks one by `config.dataset`:

- `"addition"` (default): the CPU demo, single-digit sums, generated (addition.py);
- `"countdown"`: Countdown problems, generated so that each has a solution (countdown.py);
- `"gsm8k"`: GSM8K from the Hugging Face hub through `datasets` (gsm8k.py);
- a path ending in `.jsonl`: one `{"prompt", "answer"[, "split"]}` object per line (jsonl.py).

Every task has the `Task` interface (records.py); its first reward column, `answer`, is 1/0 correctness.
"""

from __future__ import annotations

from pathlib import Path

from grpo_kernels.shown import shown
from grpo_kernels.trainer.tasks.addition import AdditionTask, closeness, exact_answer, number_format
from grpo_kernels.trainer.tasks.countdown import CountdownTask
from grpo_kernels.trainer.tasks.dataset import DatasetTask
from grpo_kernels.trainer.tasks.gsm8k import load_gsm8k
from grpo_kernels.trainer.tasks.jsonl import load_jsonl
from grpo_kernels.trainer.tasks.records import EVAL_SIZE, Prompt, PromptStream, RewardBatch, Task

DATASETS = ("addition", "countdown", "gsm8k")  # or a path ending in .jsonl

__all__ = [
    "DATASETS",
    "EVAL_SIZE",
    "AdditionTask",
    "CountdownTask",
    "DatasetTask",
    "Prompt",
    "PromptStream",
    "RewardBatch",
    "Task",
    "build_task",
    "closeness",
    "exact_answer",
    "load_gsm8k",
    "load_jsonl",
    "number_format",
]


def build_task(config) -> Task:
    """The task `config.dataset` names. Reads `dataset` ("addition"), `max_sum` (9, addition) and `eval_size`
    (`EVAL_SIZE`; addition ignores it and evaluates all of its prompts); an unknown dataset is a ValueError listing
    the valid values, raised before any data is read."""
    dataset = getattr(config, "dataset", "addition")
    eval_size = getattr(config, "eval_size", EVAL_SIZE)
    if dataset == "addition":
        return AdditionTask(max_sum=getattr(config, "max_sum", 9))
    if dataset == "countdown":
        return CountdownTask(eval_size=eval_size)
    if dataset == "gsm8k":
        return load_gsm8k(eval_size)
    if isinstance(dataset, (str, Path)) and str(dataset).endswith(".jsonl"):
        return load_jsonl(dataset, eval_size)
    raise ValueError(f"dataset must be one of {list(DATASETS)} or a path ending in .jsonl, got {shown(dataset)}")

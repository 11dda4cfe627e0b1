"""A local JSONL dataset: one `{"prompt": ..., "answer": ...}` object per line, optionally `"split": "train"|"test"`.

With no `"split": "test"` line, the last 10 % of the lines without a split (at least one) are held out for
evaluation. Columns: `answer` is 1 when the completion's final answer (the `<answer>` tag or `\\boxed{}` when
present, else the whole completion, stripped) equals the answer as text or as a decimal number, or, for an answer
with a digit or a LaTeX command and math-verify installed (the `math` extra), is mathematically equal to it
(`REWARDS["math_answer"]`: `1/2` = `0.5`); `format` is 1 when that final answer is not empty and the completion
ended with `<eos>`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch
from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.math_answer import final_answer
from grpo_kernels.trainer.tasks.dataset import DatasetTask
from grpo_kernels.trainer.tasks.records import EVAL_SIZE, Prompt

HELD_OUT_FRACTION = 0.1
SPLITS = ("train", "test")
_MATH = re.compile(r"\d|\\")  # a digit or a backslash: an answer math-verify should judge


def _prediction(completion: str) -> str:
    return final_answer(completion) or completion.strip()


def _decimal(text: str) -> Decimal | None:
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _math_equal(prediction: str, answer: str) -> bool:
    """math-verify's verdict for a math answer (one with a digit or a LaTeX command: math-verify reads words as
    case-blind products of symbols, `paris` = `Paris`); False when it is not installed or cannot read the answer."""
    if not _MATH.search(answer) or importlib.util.find_spec("math_verify") is None:
        return False
    try:
        return bool(REWARDS.get("math_answer")([f"\\boxed{{{prediction}}}"], [answer]).item())
    except ValueError:  # an answer math-verify cannot parse: only the text comparison applies
        return False


def _correct(prediction: str, answer: str) -> bool:
    if prediction == answer:
        return True
    numbers = _decimal(prediction), _decimal(answer)
    if None not in numbers:
        return numbers[0] == numbers[1]
    return bool(prediction) and _math_equal(prediction, answer)


def matches_answer(completions: list[str], answers: Sequence[str], **kwargs) -> Tensor:
    """1.0 where the final answer equals the answer as text, as a decimal, or mathematically. [B] float32."""
    completions = check_texts("completions", completions)
    return torch.tensor([float(_correct(_prediction(c), a.strip())) for c, a in zip(completions, answers, strict=True)])


def answer_present(completions: list[str], truncated: Tensor, **kwargs) -> Tensor:
    """1.0 where the final answer is not empty and the completion ended with `<eos>`, else 0.0. [B] float32."""
    completions = check_texts("completions", completions)
    present = torch.tensor([bool(_prediction(c)) for c in completions])  # [B]
    return (present & ~truncated.cpu()).float()


def _field(record: dict, key: str, where: str) -> str:
    value = record[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {key!r} must be a non-empty string (or a number), got {value!r}")
    return value


def read_jsonl(path: str | Path) -> tuple[list[Prompt], list[Prompt]]:
    """(train, test) prompts of a JSONL file; a line that is not a JSON object with `prompt` and `answer` (or has
    a `split` other than train / test) is a ValueError naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    splits: dict[str | None, list[Prompt]] = {"train": [], "test": [], None: []}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: must be a JSON object, got {type(record).__name__}")
        missing = [key for key in ("prompt", "answer") if key not in record]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}; every line needs 'prompt' and 'answer'")
        split = record.get("split")
        if split not in splits:
            raise ValueError(f"{where}: 'split' must be one of {list(SPLITS)} or absent, got {split!r}")
        splits[split].append(Prompt(_field(record, "prompt", where), _field(record, "answer", where)))
    train, test, unsplit = splits["train"], splits["test"], splits[None]
    held_out = 0 if test else max(1, round(HELD_OUT_FRACTION * len(unsplit)))
    return train + unsplit[: len(unsplit) - held_out], test + unsplit[len(unsplit) - held_out :]


def load_jsonl(path: str | Path, eval_size: int = EVAL_SIZE) -> DatasetTask:
    """The task of a local JSONL file (named by the file's stem)."""
    train, test = read_jsonl(path)
    name = Path(path).stem
    return DatasetTask(name, train, test, matches_answer, answer_present, eval_size, max_completion_length=64)

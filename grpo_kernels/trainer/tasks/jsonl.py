"""A local JSONL dataset: one `{"prompt": ..., "answer": ...}` object per line, optionally `"split": "train"|"test"`.

With no `"split": "test"` line, the last 10 % of the lines without a split (at least one) are held out for
evaluation. Columns: `answer` is 1 when the completion's final answer (the `<answer>` tag or `\\boxed{}` when
present, else the whole completion, stripped) equals the answer as text or as a decimal number, or, for an answer
with a digit or a LaTeX command and math-verify installed (the `math` extra), is mathematically equal to it
(`math_answer.verify_answers`, under its size and time limits: `1/2` = `0.5`); `format` is 1 when that final answer
is not empty and the completion ended with `<eos>`.

The file is read one line at a time; a line longer than `MAX_LINE_BYTES` (1 MiB) is an error naming the file and
line, as is any line that is not a JSON object with a prompt and an answer.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch
from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards.limits import over_limit, score_texts, too_long
from grpo_kernels.rewards.math_answer import final_answer, verify_answers
from grpo_kernels.shown import shown
from grpo_kernels.trainer.tasks.dataset import DatasetTask
from grpo_kernels.trainer.tasks.records import EVAL_SIZE, Prompt

HELD_OUT_FRACTION = 0.1
MAX_LINE_BYTES = 1 << 20  # longest line read (1 MiB, newline excluded): a longer one is an error naming the line
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


def _text_verdict(prediction: str, answer: str) -> bool | None:
    """True / False when the text or the decimal comparison decides, None when math-verify should judge: a non-empty
    prediction and a math answer (one with a digit or a LaTeX command: math-verify reads words as case-blind
    products of symbols, `paris` = `Paris`)."""
    if prediction == answer:
        return True
    numbers = _decimal(prediction), _decimal(answer)
    if None not in numbers:
        return numbers[0] == numbers[1]
    return None if prediction and _MATH.search(answer) else False


def matches_answer(completions: list[str], answers: Sequence[str], **kwargs) -> Tensor:
    """1.0 where the final answer equals the answer as text, as a decimal, or mathematically (math-verify, when
    installed; an answer it cannot parse gets the text comparison only). [B] float32. A completion over
    `limits.MAX_COMPLETION_CHARS`, or a math check over `math_answer`'s limits, scores 0 and is counted."""
    completions = check_texts("completions", completions)
    scores = [0.0] * len(completions)
    math_rows: list[tuple[int, str, str]] = []  # (row, prediction, answer) left to math-verify
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        if too_long(completion):
            scores[i] = over_limit(i)
            continue
        prediction, answer = _prediction(completion), answer.strip()
        verdict = _text_verdict(prediction, answer)
        if verdict is None:
            math_rows.append((i, prediction, answer))
        else:
            scores[i] = float(verdict)
    if math_rows and importlib.util.find_spec("math_verify") is not None:
        rows, predictions, golds = zip(*math_rows, strict=True)
        for i, verdict in zip(rows, verify_answers(list(golds), list(predictions)), strict=True):
            scores[i] = over_limit(i) if verdict == "over_limit" else float(verdict == "equal")
    return torch.tensor(scores, dtype=torch.float32)


def answer_present(completions: list[str], truncated: Tensor, **kwargs) -> Tensor:
    """1.0 where the final answer is not empty and the completion ended with `<eos>`, else 0.0. [B] float32."""
    completions = check_texts("completions", completions)
    present = score_texts(lambda c: bool(_prediction(c)), completions).bool()  # [B]
    return (present & ~truncated.cpu()).float()


def _field(record: dict, key: str, where: str) -> str:
    value = record[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {key!r} must be a non-empty string (or a number), got {shown(value)}")
    return value


def _lines(path: Path) -> Iterator[tuple[str, str]]:
    """(where, text) of each line, read one at a time; a line over `MAX_LINE_BYTES` or not UTF-8 is a ValueError."""
    with path.open("rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            where = f"{path}, line {number}"
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                raise ValueError(f"{where}: longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES); split or shorten it")
            try:
                yield where, line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 ({error.reason} at byte {error.start})") from None


def read_jsonl(path: str | Path) -> tuple[list[Prompt], list[Prompt]]:
    """(train, test) prompts of a JSONL file, read line by line; a line over `MAX_LINE_BYTES`, not UTF-8, or not a
    JSON object with `prompt` and `answer` (or with a `split` other than train / test) is a ValueError naming the
    file and line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    splits: dict[str | None, list[Prompt]] = {"train": [], "test": [], None: []}
    for where, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        except RecursionError:
            raise ValueError(f"{where}: not valid JSON here (nested too deeply)") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: must be a JSON object, got {type(record).__name__}")
        missing = [key for key in ("prompt", "answer") if key not in record]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}; every line needs 'prompt' and 'answer'")
        split = record.get("split")
        if split not in splits:
            raise ValueError(f"{where}: 'split' must be one of {list(SPLITS)} or absent, got {shown(split)}")
        splits[split].append(Prompt(_field(record, "prompt", where), _field(record, "answer", where), where))
    train, test, unsplit = splits["train"], splits["test"], splits[None]
    held_out = 0 if test else max(1, round(HELD_OUT_FRACTION * len(unsplit)))
    return train + unsplit[: len(unsplit) - held_out], test + unsplit[len(unsplit) - held_out :]


def load_jsonl(path: str | Path, eval_size: int = EVAL_SIZE) -> DatasetTask:
    """The task of a local JSONL file (named by the file's stem)."""
    train, test = read_jsonl(path)
    name = Path(path).stem
    return DatasetTask(name, train, test, matches_answer, answer_present, eval_size, max_completion_length=64)

"""GSM8K exact-answer reward: the completion's final number against the number after `#### ` in the answer."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from torch import Tensor

from grpo_kernels.checks import check_length, check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.extraction import answer_tag, last_number
from grpo_kernels.rewards.limits import score_texts


def gsm8k_target(answer: str, name: str = "answer") -> Decimal:
    """The ground truth of a GSM8K `answer` field: the text after `#### ` (or the whole field), commas removed."""
    text = answer.rsplit("####", 1)[-1].strip().replace(",", "")
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{name} must end in '#### <number>', got {answer!r}") from None
    if not value.is_finite():
        raise ValueError(f"{name} must end in a finite number, got {answer!r}")
    return value


def _score(completion: str, target: Decimal) -> bool:
    tagged = answer_tag(completion)
    predicted = last_number(completion if tagged is None else tagged)
    return predicted is not None and Decimal(predicted) == target


@REWARDS.register("gsm8k", paper="GSM8K, arXiv:2110.14168")
def gsm8k(completions: list[str], answers: list[str], **kwargs) -> Tensor:
    """1.0 when the completion's final number equals the GSM8K ground truth exactly, else 0.0.

    GSM8K (Cobbe et al., arXiv:2110.14168) stores the solution as `... #### 1,234`. The prediction is the last
    number inside the last `<answer>` tag when the completion has one, else the last number of the whole text;
    thousands commas are stripped on both sides and the comparison is exact in decimal (`72.0` equals `72`,
    `-3` is negative). No number: 0. A completion over `limits.MAX_COMPLETION_CHARS` scores 0 and is counted.
    Extra keyword arguments are ignored. Returns [B] float32.
    """
    completions = check_texts("completions", completions)
    answers = check_texts("answers", answers)
    check_length("answers", answers, len(completions))
    targets = [gsm8k_target(answer, f"answers[{i}]") for i, answer in enumerate(answers)]
    return score_texts(_score, completions, targets)

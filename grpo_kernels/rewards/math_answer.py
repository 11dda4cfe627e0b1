"""Verifiable math-answer reward: the completion's final answer checked against the ground truth by math-verify."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from grpo_kernels.checks import check_length, check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.extraction import answer_tag, last_boxed

TIMEOUT_SECONDS = 5  # math-verify's own default for parse and verify


def final_answer(completion: str) -> str | None:
    """The last `\\boxed{}` inside the last `<answer>` tag, else the tag's content, else the last `\\boxed{}`."""
    tagged = answer_tag(completion)
    if tagged is None:
        return last_boxed(completion)
    return last_boxed(tagged) or tagged or None


@REWARDS.register("math_answer", paper="DeepSeek-R1 rule-based accuracy reward, arXiv:2501.12948")
def math_answer(completions: list[str], answers: list[str], **kwargs) -> Tensor:
    """1.0 when the final answer (`\\boxed{}` or `<answer>` tag) is mathematically equal to `answers[i]`, else 0.0.

    The RLVR binary verifier reward (DeepSeek-R1, arXiv:2501.12948; spec §1): both sides are parsed by
    math-verify as `\\boxed{...}` (a gold answer also as written, e.g. `$\\frac{1}{2}$`) and compared with
    `verify(gold, prediction)`, so `0.5`, `\\frac12` and `50\\%` match. A completion with no extractable answer
    scores 0; a gold answer math-verify cannot parse is a ValueError. math-verify's 5 s timeouts apply on the
    main thread only (they need signal.alarm); in worker threads it runs untimed. Extra keyword arguments are
    ignored.
    Needs the `math` extra: pip install 'grpo-kernels[math]'. Returns [B] float32.
    """
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise ImportError("math_answer needs math-verify: pip install 'grpo-kernels[math]'") from error
    completions = check_texts("completions", completions)
    answers = check_texts("answers", answers)
    check_length("answers", answers, len(completions))
    # math-verify's timeouts use signal.alarm, which only the main thread may set; elsewhere run without them.
    timeout = TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    scores = []
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout) or parse(answer, parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"answers[{i}] must be a math answer math-verify can parse, got {answer!r}")
        predicted = final_answer(completion)
        if predicted is None:
            scores.append(0.0)
            continue
        prediction = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
        scores.append(float(verify(gold, prediction, timeout_seconds=timeout)))
    return torch.tensor(scores, dtype=torch.float32)

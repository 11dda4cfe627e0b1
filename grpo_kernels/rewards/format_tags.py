"""Format reward: the whole completion is `<think>…</think>` then `<answer>…</answer>`."""

from __future__ import annotations

import re

from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.limits import score_texts

_TAG = r"</?(?:think|answer)>"
_BODY = rf"(?:(?!{_TAG}).)*"  # any text, newlines included, that opens or closes no tag
# Linear: each body stops at the first tag, so a failed match backtracks over one body once, never nested.
THINK_ANSWER = re.compile(rf"<think>{_BODY}</think>\s*<answer>{_BODY}</answer>", re.DOTALL)


@REWARDS.register("format", paper="DeepSeek-R1 format reward, arXiv:2501.12948")
def format_reward(completions: list[str], **kwargs) -> Tensor:
    """1.0 when the whole completion is `<think>…</think>` + whitespace + `<answer>…</answer>`, else 0.0.

    The R1-Zero template (DeepSeek-R1, arXiv:2501.12948), checked strictly: the regex must match the entire
    string (no text before `<think>` or after `</answer>`), each tag appears exactly once, and neither body
    contains another think/answer tag, so repeated, nested or unclosed tags score 0. A completion over
    `limits.MAX_COMPLETION_CHARS` scores 0 and is counted. Extra keyword arguments are ignored. Returns [B] float32.
    """
    completions = check_texts("completions", completions)
    return score_texts(lambda c: THINK_ANSWER.fullmatch(c) is not None, completions)

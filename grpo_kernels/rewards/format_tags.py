"""Format reward: the whole completion is `<think>…</think>` then `<answer>…</answer>`."""

from __future__ import annotations

import re

import torch
from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards import REWARDS

_TAG = r"</?(?:think|answer)>"
_BODY = rf"(?:(?!{_TAG}).)*"  # any text, newlines included, that opens or closes no tag
THINK_ANSWER = re.compile(rf"<think>{_BODY}</think>\s*<answer>{_BODY}</answer>", re.DOTALL)


@REWARDS.register("format", paper="DeepSeek-R1 format reward, arXiv:2501.12948")
def format_reward(completions: list[str], **kwargs) -> Tensor:
    """1.0 when the whole completion is `<think>…</think>` + whitespace + `<answer>…</answer>`, else 0.0.

    The R1-Zero template (DeepSeek-R1, arXiv:2501.12948), checked strictly: the regex must match the entire
    string (no text before `<think>` or after `</answer>`), each tag appears exactly once, and neither body
    contains another think/answer tag, so repeated, nested or unclosed tags score 0. Extra keyword arguments
    are ignored. Returns [B] float32.
    """
    completions = check_texts("completions", completions)
    return torch.tensor([float(THINK_ANSWER.fullmatch(c) is not None) for c in completions], dtype=torch.float32)

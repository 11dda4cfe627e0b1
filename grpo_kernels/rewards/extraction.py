"""Final-answer extraction from completion text: the `<answer>` tag, `\\boxed{}` and the last number."""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
# A decimal number with optional thousands commas and sign; a '-' right after a digit is subtraction, not a sign.
_NUMBER = re.compile(r"(?<![\d.,])-?\d+(?:,\d{3})*(?:\.\d+)?")


def answer_tag(text: str) -> str | None:
    """Stripped content of the last complete `<answer>…</answer>`, or None."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}` whose braces balance, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, begin = 1, start + len(_BOXED)
        for end in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[begin:end].strip()
        start = text.rfind(_BOXED, 0, start)
    return None


def last_number(text: str) -> str | None:
    """The last decimal number in the text with its thousands commas removed ("-1,234.5" -> "-1234.5"), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None

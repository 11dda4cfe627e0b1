"""Final-answer extraction from completion text: the `<answer>` tag, `\\boxed{}` and the last number.

Each is one left-to-right scan (linear in the text), so a completion full of unclosed tags or braces costs no more
than any other of its length.
"""

from __future__ import annotations

import re

_OPEN, _CLOSE = "<answer>", "</answer>"
_BOXED = "\\boxed{"
_BRACES = re.compile(r"[{}]")
# A decimal number with optional thousands commas and sign; a '-' right after a digit is subtraction, not a sign.
_NUMBER = re.compile(r"(?<![\d.,])-?\d+(?:,\d{3})*(?:\.\d+)?")


def answer_tag(text: str) -> str | None:
    """Stripped content of the last complete `<answer>…</answer>`, or None.

    The tags pair as a left-to-right scan pairs them: an opening tag with the first closing tag after it, the next
    pair starting after that closing tag (so `<answer>a<answer>b</answer>` holds `a<answer>b`)."""
    last, start = None, 0
    while (begin := text.find(_OPEN, start)) != -1:
        end = text.find(_CLOSE, begin + len(_OPEN))
        if end == -1:
            break
        last, start = (begin + len(_OPEN), end), end + len(_CLOSE)
    return None if last is None else text[last[0] : last[1]].strip()


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}` whose braces balance, or None.

    One scan of the braces from the first `\\boxed{` on: each `{` is pushed, each `}` closes the innermost open one
    (a `}` with none open is ignored), and the boxed braces that close are the candidates; the last opened wins."""
    first = text.find(_BOXED)
    if first == -1:
        return None
    boxed = set()  # positions of the `{` of each `\boxed{`
    at = first
    while at != -1:
        boxed.add(at + len(_BOXED) - 1)
        at = text.find(_BOXED, at + len(_BOXED))
    open_braces: list[int] = []
    best = None
    for match in _BRACES.finditer(text, first):
        at = match.start()
        if text[at] == "{":
            open_braces.append(at)
        elif open_braces:
            begin = open_braces.pop()
            if begin in boxed and (best is None or begin > best[0]):
                best = (begin, at)
    return None if best is None else text[best[0] + 1 : best[1]].strip()


def last_number(text: str) -> str | None:
    """The last decimal number in the text with its thousands commas removed ("-1,234.5" -> "-1234.5"), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None

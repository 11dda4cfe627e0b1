"""Every page of the docs renders whole: each page is parsed with markdown-it (CommonMark) and fails on the marks of a
cut-and-paste — a code fence left open (it swallows the rest of the page), a heading inside a code block, a paragraph
that begins mid-sentence (with a lower-case word, or with more closing than opening parentheses) or ends without
punctuation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "grpo_kernels" / "kernels" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
CLOSING_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*$")
HEADING = re.compile(r"^#{2,6} \S")  # a Markdown heading; a one-# line in a code block is a comment
ENDINGS = (".", ":", "!", "?", ")")
LOWER_CASE_NAMES = ("verl", "vLLM", "bf16", "fp16", "fp32", "e.g.", "i.e.")  # may begin a sentence as they are written


def _tokens(path: Path) -> list[Token]:
    return MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8"))


def _where(path: Path, token: Token) -> str:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{name}:{token.map[0] + 1}"


def problems(path: Path) -> list[str]:
    """What looks cut and pasted on the page, one line each (file:line: what)."""
    lines, found = path.read_text(encoding="utf-8").splitlines(), []
    tokens = _tokens(path)
    for i, token in enumerate(tokens):
        if token.type == "fence":
            last = lines[token.map[1] - 1] if token.map[1] - 1 > token.map[0] else ""
            if not CLOSING_FENCE.match(last):
                found.append(f"{_where(path, token)}: a code fence is never closed (it runs to the end of the page)")
            inside = [line for line in token.content.splitlines() if HEADING.match(line)]
            if inside:
                found.append(f"{_where(path, token)}: a heading inside a code block: {inside[0]!r}")
        if token.type == "paragraph_open" and not (i > 0 and tokens[i - 1].type == "list_item_open"):
            found += _paragraph(path, token, tokens[i + 1].content)
    return found


def _paragraph(path: Path, token: Token, text: str) -> list[str]:
    where, out = _where(path, token), []
    plain = text.strip()
    if plain.startswith("<!--"):
        return out
    first = plain.split()[0] if plain else ""
    if first[:1].isascii() and first[:1].islower() and not first.startswith(LOWER_CASE_NAMES):
        out.append(f"{where}: a paragraph begins mid-sentence: {plain[:60]!r}")
    depth = 0
    for char in re.sub(r"`[^`]*`", "", plain):  # code spans may hold unbalanced brackets
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            out.append(f"{where}: a paragraph closes a parenthesis it never opened: {plain[:60]!r}")
            break
    if plain and not plain.endswith(ENDINGS) and not plain.endswith(("**", "`", "|")):
        out.append(f"{where}: a paragraph ends mid-sentence: {plain[-60:]!r}")
    return out


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_the_page_renders_whole(path):
    found = problems(path)
    assert not found, "\n".join(found)


def test_the_checks_catch_each_kind_of_damage(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nA whole sentence.\n\n`GRPOLoss`): a fragment.\n\nthe rest of a sentence.\n\n"
        "A sentence cut in the middle of\n\n```bash\nrun\n```\n\ncode\n```\n## Swallowed\n\nText.\n",
        encoding="utf-8",
    )
    found = "\n".join(problems(page))
    assert "closes a parenthesis it never opened" in found
    assert "begins mid-sentence: 'the rest" in found
    assert "ends mid-sentence: 'A sentence cut in the middle of'" in found
    assert "a heading inside a code block: '## Swallowed'" in found
    assert "never closed" in found

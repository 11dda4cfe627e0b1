"""docs/engine.md names the package's files on a call's path: each name it gives is a file (or folder) of the
package, so the walk-through cannot drift from the tree."""

import re
from pathlib import Path

import grpo_kernels as gk

PACKAGE = Path(gk.__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "engine.md"
NAME = re.compile(r"\b((?:engine|kernels|losses)(?:/[A-Za-z_]+)+)(\.py|\.md)?")


def test_every_file_the_engine_doc_names_exists():
    names = {m.group(1) + (m.group(2) or "") for m in NAME.finditer(DOC.read_text())}
    assert len(names) > 20, "the doc names the files of a call's path"
    missing = [
        name for name in sorted(names) if not any((PACKAGE / candidate).exists() for candidate in (name, name + ".py"))
    ]
    assert not missing, missing

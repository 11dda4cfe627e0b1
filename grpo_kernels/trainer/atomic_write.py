"""Files rewritten whole (a run's `config.yaml`, `metrics.jsonl` on resume, compare's results, the plots) are never
truncated in place: the new content goes to a temporary file beside the old one, is fsynced, then renamed over it.
A write cut short (a file-size limit, a full disk, SIGKILL) leaves the old file whole and removes the temporary one
(SIGKILL aside, which leaves a `.<name>.<pid>.tmp` beside it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` (same suffix) to write; on leaving the block without an error it is fsynced
    and renamed to `path`, on an error removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)


def write_text(path: str | Path, text: str) -> None:
    """`path` holds `text` (UTF-8), or, when the write fails, what it held before."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def fsync(path: Path) -> None:
    """Flush `path` (a file or a directory) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

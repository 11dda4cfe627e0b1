"""One writer per run directory: `claim` takes an exclusive `fcntl.flock` on `<directory>/.run.lock`, which holds
the writer's PID. The operating system releases it when the process ends, however it ends (SIGKILL included), so a
stale lock never blocks a later run. A second `train`, `--resume` or `compare` on the directory is a `RunInUse`
naming the holder's PID. A process may claim a directory it holds again (a run resumed in the same process)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_FILE = ".run.lock"
_held: dict[Path, int] = {}  # the directories this process holds: their lock file's descriptor


class RunInUse(ValueError):
    """Another process holds the run directory's lock."""


def claim(directory: str | Path) -> Path:
    """Create `directory` if needed and take its lock for this process (until `release` or the process ends);
    returns the resolved directory. A `RunInUse` names the PID of the process that holds it."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output_dir {str(path)!r} is a file: --output-dir needs a directory (new or empty)")
    path.mkdir(parents=True, exist_ok=True)
    path = path.resolve()
    if path in _held:
        return path
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RunInUse(
            f"{str(directory)!r} is in use by process {holder_pid(path)} (a train, --resume or compare writing "
            "there): wait for it to end, or choose another --output-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[path] = fd
    return path


def release(directory: str | Path) -> None:
    """Give up this process's lock on `directory` (nothing when it holds none)."""
    fd = _held.pop(Path(directory).resolve(), None)
    if fd is not None:
        os.close(fd)


def holder(directory: str | Path) -> str | None:
    """The PID of another process that holds `directory`'s lock now ("unknown" when unreadable), or None."""
    path = Path(directory).resolve()
    if path in _held or not (path / LOCK_FILE).is_file():
        return None
    fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return holder_pid(path)
    finally:
        os.close(fd)
    return None


def holder_pid(directory: Path) -> str:
    """The PID written in the lock file (the holder's), or "unknown"."""
    try:
        text = (directory / LOCK_FILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return text if text.isdigit() else "unknown"

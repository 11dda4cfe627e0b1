"""One writer per run directory: `claim` takes an exclusive `fcntl.flock` on `<directory>/.run.lock`, which holds
the writer's PID. The operating system releases it when the process ends, however it ends (SIGKILL included), so a
stale lock never blocks a later run. A second `train`, `--resume` or `compare` on the directory is a `RunInUse`
naming the holder's PID. A process may claim a directory it holds again (a run resumed in the same process).
The lock file is opened without following a symbolic link (`O_NOFOLLOW`): a link, a FIFO or anything else that is
not a regular file there is an `UnsafeLockFile` naming it, so nothing outside the run directory is ever written."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

LOCK_FILE = ".run.lock"
_held: dict[Path, int] = {}  # the directories this process holds: their lock file's descriptor


class RunInUse(ValueError):
    """Another process holds the run directory's lock."""


class UnsafeLockFile(ValueError):
    """The run directory's lock file is a symbolic link, a FIFO or another file that is not a regular file."""


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
    fd = _open_lock(path / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        pid = holder_pid(fd)
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RunInUse(
            f"{str(directory)!r} is in use by process {pid} (a train, --resume or compare writing "
            "there): wait for it to end, or choose another --output-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[path] = fd
    return path


def _open_lock(lock: Path, flags: int) -> int:
    """The lock file's descriptor, opened with `flags` without following a link and without blocking (a FIFO);
    an `UnsafeLockFile` naming it when it is not a regular file."""
    flags |= os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(lock, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _unsafe(lock, "a symbolic link") from None
        if error.errno in (errno.EISDIR, errno.ENXIO):
            raise _unsafe(lock, "a directory" if error.errno == errno.EISDIR else "a socket") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _unsafe(lock, "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file")
    return fd


def _unsafe(lock: Path, kind: str) -> UnsafeLockFile:
    return UnsafeLockFile(
        f"{str(lock)!r} is {kind}, not the run lock this trainer writes: it is refused rather than written through; "
        "remove it (a train, --resume or compare creates the lock file itself)"
    )


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
    try:
        fd = _open_lock(path / LOCK_FILE, os.O_RDONLY)
    except (UnsafeLockFile, OSError):
        return None  # no process holds a lock there: `claim` refuses such a file
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return holder_pid(fd)
    finally:
        os.close(fd)
    return None


def holder_pid(fd: int) -> str:
    """The PID written in the open lock file `fd` (the holder's), or "unknown"."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return text if text.isdigit() else "unknown"

"""math-verify in worker processes with a hard time limit, callable from any thread.

math-verify's own timeouts use `signal.alarm`, which only the main thread may set, and sympy can run for hours (and
fill memory) on `\\boxed{10^{10^{10}}}`. Here each verification runs in a worker process (math_worker.py) that stops
Python-level work at the limit with its own timer; a worker that has not answered `KILL_GRACE_SECONDS` later (stuck
in C, e.g. a huge integer power) is killed and replaced at once, so the next job finds one already starting.
Workers start on first use, are reused across calls and threads (one caller at a time each, at most `MAX_WORKERS`),
and stop at exit; a worker whose trainer died reads end-of-file and exits. POSIX only (`select` on pipes).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("math_worker.py")
MAX_WORKERS = 4  # worker processes at most; further concurrent callers wait for a free one
STARTUP_SECONDS = 120.0  # a worker imports math-verify and sympy (~1 s); one not ready by then is an error
KILL_GRACE_SECONDS = 0.5  # past its limit, a job whose worker has not answered is over the limit: the worker is killed
MEMORY_BYTES = 2 << 30  # address-space limit of a worker (RLIMIT_AS): a huge allocation fails there, not here
VERDICTS = ("equal", "different", "bad_gold", "over_limit")


class _Worker:
    """One worker process, restarted when it had to be killed; used by one thread at a time."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        path = os.pathsep.join(p for p in sys.path if p)  # the worker imports math-verify from where this process does
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        command = [sys.executable, str(WORKER_SCRIPT), str(MEMORY_BYTES)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.ready, self.pending = False, b""

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process.stdin.close()
            self.process.stdout.close()
            self.process = None

    def verdict(self, job: dict) -> str:
        """The worker's verdict on `job` ({"gold", "predicted", "seconds"}); "over_limit" when it did not answer
        within `seconds` + `KILL_GRACE_SECONDS` (it is then killed and restarted) or died on the job."""
        if self.process is None or self.process.poll() is not None:
            self.stop()
            self._start()
        try:
            if not self.ready:
                self._wait_ready()
            self.process.stdin.write(json.dumps(job).encode() + b"\n")
            self.process.stdin.flush()
            line = self._line(job["seconds"] + KILL_GRACE_SECONDS)
        except BrokenPipeError:
            line = b""
        except BaseException:  # e.g. KeyboardInterrupt mid-job: a late reply must not answer the next job
            self.stop()
            raise
        if not line:  # None: still busy past the limit; b"": it died (killed from outside, out of memory)
            self.stop()
            self._start()
            return "over_limit"
        return json.loads(line)["verdict"]

    def _wait_ready(self) -> None:
        line = self._line(STARTUP_SECONDS)
        if line != b"ready":
            status = self.process.poll()
            self.stop()
            why = f"exited with status {status}" if status is not None else f"was not ready in {STARTUP_SECONDS:.0f} s"
            raise RuntimeError(
                f"the math-verify worker ({sys.executable} {WORKER_SCRIPT}) {why}; its error, if any, is above "
                "(math_answer needs math-verify importable by that interpreter: pip install 'grpo-kernels[math]')"
            )
        self.ready = True

    def _line(self, seconds: float) -> bytes | None:
        """The worker's next line; None when none came within `seconds`, b"" when it exited."""
        deadline = time.monotonic() + seconds
        stdout = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([stdout], [], [], remaining)[0]:
                return None
            chunk = os.read(stdout, 1 << 16)
            if not chunk:
                return b""
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line


class _Pool:
    """Idle workers, handed to one caller at a time; at most `MAX_WORKERS` exist."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_WORKERS)
        self.idle: list[_Worker] = []
        self.pid = os.getpid()

    @contextmanager
    def worker(self) -> Iterator[_Worker]:
        with self.slots:
            with self.lock:
                if self.pid != os.getpid():  # a forked child: the parent's workers are not ours to talk to
                    self.idle, self.pid = [], os.getpid()
                worker = self.idle.pop() if self.idle else None
            worker = worker or _Worker()
            try:
                yield worker
            finally:
                with self.lock:
                    self.idle.append(worker)

    def close(self) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        if self.pid == os.getpid():
            for worker in workers:
                worker.stop()


_POOL = _Pool()
atexit.register(_POOL.close)


def verdicts(jobs: list[dict]) -> list[str]:
    """One verdict per job, in order, from one worker: "equal", "different", "bad_gold" (math-verify cannot parse
    the gold answer) or "over_limit" (the job ran past its `seconds` and the worker was killed)."""
    if not jobs:
        return []
    with _POOL.worker() as worker:
        return [worker.verdict(job) for job in jobs]

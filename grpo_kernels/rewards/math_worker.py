"""The math-verify worker process that `math_pool` starts: `python math_worker.py <address-space bytes>`.

Run as a script, so it imports math-verify and the standard library only (not torch, not grpo_kernels). It prints
`ready` once math-verify is imported, then reads one JSON job per line on stdin, `{"gold", "predicted", "seconds"}`,
and writes one JSON line per job, `{"verdict": "equal" | "different" | "bad_gold" | "over_limit"}`. Each job runs
under a timer of its own (`setitimer`: the worker's main thread may use signals, unlike the trainer's threads) that
stops Python-level work at `seconds`; work stuck in C (a huge integer power) is stopped by `math_pool` killing the
process. The address space is capped, so a huge allocation is a MemoryError here, never the machine's memory.
"""

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # the rewards folder is not a place to import from: its modules would shadow real ones

import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
from functools import lru_cache  # noqa: E402


class _Timeout(BaseException):
    """Raised by the job timer; a BaseException so that math-verify's `except Exception` does not swallow it."""


def _expire(signum, frame):
    raise _Timeout


def _limit_memory(limit: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass


def main() -> None:
    _limit_memory(int(sys.argv[1]))
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything printed by math-verify or sympy goes to stderr, never into the replies
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled": the timer here replaces it
    signal.signal(signal.SIGALRM, _expire)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which closes stdin to stop this

    @lru_cache(maxsize=4096)
    def gold_of(answer: str) -> list:
        return parse(f"\\boxed{{{answer}}}", parsing_timeout=None) or parse(answer, parsing_timeout=None)

    def verdict(job: dict) -> str:
        gold = gold_of(job["gold"])
        if not gold:
            return "bad_gold"
        if job["predicted"] is None:
            return "different"
        prediction = parse(f"\\boxed{{{job['predicted']}}}", parsing_timeout=None)
        return "equal" if verify(gold, prediction, timeout_seconds=None) else "different"

    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            signal.setitimer(signal.ITIMER_REAL, job["seconds"])
            try:
                result = verdict(job)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except (_Timeout, MemoryError, RecursionError):
            result = "over_limit"
        except Exception:  # math-verify returns False on its own errors; anything else it raises counts the same
            result = "different"
        print(json.dumps({"verdict": result}), file=replies, flush=True)


if __name__ == "__main__":
    main()

"""`python -m tests.trl_suite`: TRL's whole GRPO test file (or `--ci`: the CI selection), stock and drop-in, and a
table of the outcomes; exits 1 when a test's outcomes differ, 2 when TRL's test file cannot be had."""

from __future__ import annotations

import argparse
import collections
import sys
import time

from tests.trl_suite import selection, source
from tests.trl_suite.run import run_suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trl_suite", description=__doc__)
    parser.add_argument("--ci", action="store_true", help="only the CI selection (tests.trl_suite.selection.CI)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run (default 7200)")
    parser.add_argument("pytest_args", nargs="*", help="passed to both pytest runs (after --), e.g. -k peft")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        result = run_suite(list(selection.CI) if args.ci else None, args.timeout, tuple(args.pytest_args))
    except source.Unavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    pairs = result.pairs()
    for test, (stock, ours) in pairs.items():
        mark = "  " if stock.outcome == ours.outcome else "≠ "
        print(f"{mark}{stock.outcome:>8} {ours.outcome:>8}  {test}")
        for name, outcome in (("stock", stock), ("drop-in", ours)):
            if outcome.outcome in ("failed", "error") or (mark != "  " and outcome.message):
                print(f"      {name}: {outcome.message}")
    counts = collections.Counter((stock.outcome, ours.outcome) for stock, ours in pairs.values())
    print(f"TRL's tests from {result.origin}; {len(pairs)} tests in {time.monotonic() - start:.0f} s")
    print("stock / drop-in: " + ", ".join(f"{a} / {b}: {n}" for (a, b), n in sorted(counts.items())))
    differing = result.differing()
    print(f"{len(differing)} tests with different outcomes" if differing else "the same outcome for every test")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())

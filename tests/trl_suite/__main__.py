"""`python -m tests.trl_suite`: TRL's whole GRPO test file (or `--ci`: the CI selection), stock and drop-in, and a
table of the outcomes; exits 1 when a test's outcomes differ (or the drop-in's fused loss never ran, or, with
`--ci`, fewer than MIN_PASSED of the selection passed), 2 when TRL's test file cannot be had (0 with
`--skip-unavailable`, saying why)."""

from __future__ import annotations

import argparse
import collections
import sys
import time

from tests.trl_suite import selection, source
from tests.trl_suite.run import run_suite

MIN_PASSED = 0.8  # the share of the CI selection that must pass in both runs: stand-ins that broke would fail all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trl_suite", description=__doc__)
    parser.add_argument("--ci", action="store_true", help="only the CI selection (tests.trl_suite.selection.CI)")
    parser.add_argument("--skip-unavailable", action="store_true", help="exit 0 when TRL's test file cannot be had")
    parser.add_argument("--timeout", type=float, help="seconds per run (default 1200 with --ci, else 7200)")
    parser.add_argument("pytest_args", nargs="*", help="passed to both pytest runs (after --), e.g. -k peft")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        timeout_s = args.timeout or (1200.0 if args.ci else 7200.0)
        result = run_suite(list(selection.CI) if args.ci else None, timeout_s, tuple(args.pytest_args))
    except source.Unavailable as error:
        if args.skip_unavailable:
            print(f"skipped: {error}")
            return 0
        print(f"error: {error}", file=sys.stderr)
        return 2
    pairs = result.pairs()
    for test, (stock, ours) in pairs.items():
        mark = "  " if stock.outcome == ours.outcome else "≠ "
        print(f"{mark}{stock.outcome:>8} {ours.outcome:>8} {stock.seconds:6.1f} s {ours.seconds:6.1f} s  {test}")
        for name, outcome in (("stock", stock), ("drop-in", ours)):
            if outcome.outcome in ("failed", "error") or (mark != "  " and outcome.message):
                print(f"      {name}: {outcome.message}")
    counts = collections.Counter((stock.outcome, ours.outcome) for stock, ours in pairs.values())
    print(f"TRL's tests from {result.origin}; {len(pairs)} tests in {time.monotonic() - start:.0f} s")
    if result.supplied:
        names = ", ".join(result.supplied)
        print(f"names those tests import that the installed TRL lacks, supplied as package checks: {names}")
    print("stock / drop-in: " + ", ".join(f"{a} / {b}: {n}" for (a, b), n in sorted(counts.items())))
    print(f"the drop-in's fused loss ran {result.fused_loss_calls} times")
    differing = result.differing()
    print(f"{len(differing)} tests with different outcomes" if differing else "the same outcome for every test")
    passed = sum(stock.outcome == ours.outcome == "passed" for stock, ours in pairs.values())
    too_few = args.ci and passed < MIN_PASSED * len(selection.CI)
    if too_few:
        print(f"only {passed} of the {len(selection.CI)} selected tests passed in both runs")
    return 1 if differing or too_few or result.fused_loss_calls == 0 else 0


if __name__ == "__main__":
    sys.exit(main())

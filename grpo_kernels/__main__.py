"""`python -m grpo_kernels`: the package's commands, one line each, and its version."""

from __future__ import annotations

import sys

from grpo_kernels import __version__

COMMANDS = {
    "train": "GRPO training: the CPU demo with no arguments, a paper preset with --preset NAME",
    "compare": "train several paper presets with one seed and budget; a table and reward curves",
    "evaluate": "greedy accuracy of a checkpoint or a run directory (and the difference to a second one)",
}


def main(argv: list[str] | None = None) -> None:
    """The command list; `--version` prints the version alone, `--help` the list; anything else is an error."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        print(f"grpo-kernels {__version__}")
        return
    if args and args != ["--help"] and args != ["-h"]:
        print(f"error: python -m grpo_kernels takes --version or --help, got {' '.join(args)}", file=sys.stderr)
        raise SystemExit(2)
    print(f"grpo-kernels {__version__}: fused GRPO loss kernels and a small trainer. Commands:")
    for name, what in COMMANDS.items():
        print(f"  python -m grpo_kernels.{name:<9} {what}")
    print("Each takes --help; the library: import grpo_kernels (README.md, docs/).")


if __name__ == "__main__":
    main()

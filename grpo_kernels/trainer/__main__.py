"""`python -m grpo_kernels.train` (or `python -m grpo_kernels.trainer`): with no arguments, the embedded demo —
a tiny Llama built from a config learns single-digit addition from reward alone, on CPU, in a few minutes."""

from __future__ import annotations

from collections.abc import Sequence

from grpo_kernels.trainer.config import parse_args
from grpo_kernels.trainer.train import train


def main(argv: Sequence[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()

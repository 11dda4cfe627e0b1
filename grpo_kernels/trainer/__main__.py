"""`python -m grpo_kernels.train` (or `python -m grpo_kernels.trainer`): with no arguments, the embedded demo —
a tiny Llama built from a config learns single-digit addition from reward alone, on CPU, in a few minutes.

A user error (a bad option, a missing file, a run directory that holds another run) is one line, `error: ...`, and
exit status 2 (`--debug`: the traceback). The trainer is imported after the command line is read, so `--help` and
option errors answer without loading transformers."""

from __future__ import annotations

from collections.abc import Sequence

from grpo_kernels.trainer import cli
from grpo_kernels.trainer.config import parse_args
from grpo_kernels.trainer.offline import require_model


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_train, argv)


def _train(argv: Sequence[str]) -> None:
    config = parse_args(argv)
    require_sources(config.model, config.dataset)  # before transformers is imported: fails fast offline
    from grpo_kernels.trainer.train import train

    train(config)


def require_sources(model: str, dataset: str) -> None:
    """`offline.require_model` and, for GSM8K, the dataset's `require_hub`: what the command checks before its heavy
    imports (the task module is imported only for GSM8K: the tasks load slowly)."""
    if model != "tiny":
        require_model(model)
    if dataset == "gsm8k":
        from grpo_kernels.trainer.tasks.gsm8k import require_gsm8k

        require_gsm8k()


if __name__ == "__main__":
    main()

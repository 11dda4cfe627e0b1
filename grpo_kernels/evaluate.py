"""`python -m grpo_kernels.evaluate --model A [--compare B]`: accuracy and reward of greedy decoding on a task's
held-out prompts, for one policy or two (typically a run's initial and final checkpoints) and their difference.
A trainer checkpoint's files are checked against its `checksums.json` first, as `--resume` checks them.

A model is a trainer checkpoint (`<output_dir>/checkpoints/step_000600/`: a Hugging Face model directory with its
tokenizer), a run directory (its latest checkpoint) or any Hugging Face model name or directory. The settings
(`dataset`, `max_sum`, `eval_size`, `max_completion_length`) are, highest first: the flags, the `config.yaml` of the run
a checkpoint came from (A's run, else B's), `TrainConfig`'s defaults. Prints a table (rich when installed) of both
models' `eval/*` metrics (`answer` is the accuracy) and B − A; `--output results.json` writes the same as JSON. A user
error (a model path that does not exist, an unknown dataset, a device this machine lacks) is one line, `error: ...`, and
exit status 2 (`--debug`: the traceback); torch and transformers are imported after the command line is read.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from grpo_kernels.trainer.checkpoint import CHECKPOINTS, latest, verify
from grpo_kernels.trainer.cli import Parser, run
from grpo_kernels.trainer.config import TrainConfig, check_config, from_dict, yaml_mapping
from grpo_kernels.trainer.evaluate import EVAL_BATCH_SIZE, evaluate
from grpo_kernels.trainer.offline import require_model

SETTINGS = ("dataset", "max_sum", "eval_size", "max_completion_length")  # TrainConfig fields the evaluation uses


def _at_least(minimum: int):
    def convert(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    convert.__name__ = "int"
    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m grpo_kernels.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        required=True,
        help="model A: a run directory (its latest checkpoint), a checkpoint (<run>/checkpoints/step_N) or a Hugging "
        "Face name or directory",
    )
    parser.add_argument("--compare", help="a second model (B), e.g. the final checkpoint; the table shows B − A")
    parser.add_argument(
        "--dataset", help="one of: addition, countdown, gsm8k, or a .jsonl path (default: the run's, else addition)"
    )
    parser.add_argument("--max-sum", "--max_sum", dest="max_sum", type=_at_least(0), help="addition's largest sum")
    parser.add_argument(
        "--eval-size", "--eval_size", dest="eval_size", type=_at_least(1), help="at most this many held-out prompts"
    )
    parser.add_argument(
        "--max-completion-length",
        "--max_completion_length",
        dest="max_completion_length",
        type=_at_least(1),
        help="generation budget in tokens (default: the run's, else the dataset's)",
    )
    parser.add_argument(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=_at_least(1),
        default=EVAL_BATCH_SIZE,
        help=f"prompts per generate call (default: {EVAL_BATCH_SIZE})",
    )
    parser.add_argument("--device", default="auto", help="one of: auto (cuda when available), cpu, cuda, cuda:N")
    parser.add_argument("--output", help="write the results as JSON to this file")
    return parser


def checkpoint_of(model: str) -> str:
    """`model`, or the latest complete checkpoint when `model` is a run directory (one with `checkpoints/`); a run
    directory without a checkpoint is a ValueError."""
    path = Path(model)
    if not (path / CHECKPOINTS).is_dir() or (path / "config.json").is_file():
        return model
    found = latest(path)
    if found is None:
        raise ValueError(f"model {model!r}: a run directory without a complete checkpoint in {path / CHECKPOINTS}")
    return str(found)


def run_settings(model: str) -> dict:
    """The evaluation settings in the `config.yaml` of the run whose checkpoint `model` is, else {}; checked as the
    trainer checks them (a ValueError / TypeError naming the file and the setting)."""
    path = Path(model)
    config_file = path.parent.parent / "config.yaml"
    if not (path.is_dir() and path.parent.name == CHECKPOINTS and config_file.is_file()):
        return {}
    config = yaml_mapping(config_file)
    settings = {key: config[key] for key in SETTINGS if config.get(key) is not None}
    try:
        check_config(from_dict(settings, where=str(config_file)))
    except (TypeError, ValueError) as error:
        raise type(error)(f"{config_file}: {error}") from None
    return settings


def resolve_settings(args: argparse.Namespace) -> dict:
    """Flags over the run's config.yaml (A's, else B's) over TrainConfig's defaults."""
    defaults = TrainConfig()
    settings = {key: getattr(defaults, key) for key in SETTINGS if getattr(defaults, key, None) is not None}
    for model in (args.compare, args.model):  # A's run last, so it wins
        if model is not None:
            settings.update(run_settings(model))
    settings.update({key: getattr(args, key) for key in SETTINGS if getattr(args, key) is not None})
    return settings


def load_model(name: str, device):
    """(model, tokenizer) from a Hugging Face directory or hub name, float32, left padding; a ValueError naming
    `name` when it is neither."""
    from grpo_kernels.trainer.model import load_pretrained

    model, tokenizer = load_pretrained(name)
    return model.to(device), tokenizer


def compare(metrics: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """`metrics − baseline` for every metric both have."""
    return {name: metrics[name] - baseline[name] for name in metrics if name in baseline}


def table(results: dict) -> tuple[str, list[str], list[list[str]]]:
    """(title, header, rows): one row per metric (accuracy, reward, the other columns), one column per model, B − A."""
    columns = [("A", results["model"]["metrics"], "{:.3f}")]
    if "compare" in results:
        columns += [("B", results["compare"]["metrics"], "{:.3f}"), ("B − A", results["difference"], "{:+.3f}")]
    header = ["metric"] + [label for label, _, _ in columns]
    rows = [
        ["accuracy (answer)" if name == "answer" else name] + [fmt.format(values[name]) for _, values, fmt in columns]
        for name in sorted(results["model"]["metrics"], key=lambda name: (name != "answer", name != "reward"))
    ]
    title = f"{results['settings']['dataset']}, {results['num_prompts']} held-out prompts, greedy"
    return title, header, rows


def print_table(results: dict) -> None:
    """The results table (rich when installed, else plain text) between a title and which model is A and B."""
    title, header, rows = table(results)
    legend = "\n".join(
        f"{role} = {results[key]['name']}" for role, key in (("A", "model"), ("B", "compare")) if key in results
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]
        lines = [
            "  ".join([row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))])
            for row in [header, *rows]
        ]
        print("\n".join([title, *lines, legend]))
        return
    rich_table = Table(*header)
    for row in rows:
        rich_table.add_row(*row)
    Console().print(title, rich_table, legend, soft_wrap=True, markup=False, highlight=False)  # paths as written


def main(argv: Sequence[str] | None = None) -> dict:
    """Evaluate `--model` (and `--compare`); print the table, write `--output`; returns the results."""
    args = build_parser().parse_args(argv)
    import torch

    from grpo_kernels.trainer.parallel import check_device
    from grpo_kernels.trainer.tasks import build_task

    args.model = checkpoint_of(args.model)
    args.compare = None if args.compare is None else checkpoint_of(args.compare)
    settings = resolve_settings(args)
    check_device(args.device)
    task = build_task(argparse.Namespace(**settings))  # a bad dataset fails here, before any model is loaded
    for model in (args.model, args.compare):
        if model is not None:
            require_model(model)  # before transformers is imported: fails fast offline
            verify(model)  # a trainer checkpoint's files against its checksums.json, as --resume checks them
    from grpo_kernels.trainer.model import check_lengths, model_context

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    results: dict = {"settings": settings, "num_prompts": len(task.eval_prompts())}
    for role, name in (("model", args.model), ("compare", args.compare)):
        if name is None:
            continue
        model, tokenizer = load_model(name, device)
        budget = settings.get("max_completion_length") or task.max_completion_length
        check_lengths(tokenizer, task.eval_prompts(), budget, model_context(model), f"the context of {name}")
        metrics = evaluate(model, tokenizer, task, budget, args.batch_size)
        results[role] = {"name": name, "metrics": {key.removeprefix("eval/"): v for key, v in metrics.items()}}
        del model  # free A before B is loaded
    if args.compare is not None:
        results["difference"] = compare(results["compare"]["metrics"], results["model"]["metrics"])
    print_table(results)
    if args.output is not None:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    run(main)

"""The command line, generated from the fields: `--output-dir runs/x` (or `--output_dir`), `--steps 100`,
`--resume` / `--no-resume`; the loss options are `LossOptions`' own fields, flat (`--loss-type dapo`, `--beta 0.04`,
`--epsilon-high 0.28`). `None` is written `none`. Each option's help is the comment next to its field (in
`record.py`, and in `grpo_kernels/options.py` for the loss options), with its choices: a new field is a new flag.
Nothing here imports transformers or the trainer, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from collections.abc import Sequence
from typing import Any

from grpo_kernels import presets
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.cli import Parser
from grpo_kernels.trainer.config.checks import choices
from grpo_kernels.trainer.config.record import NOT_CLI, PER_STEP_LOSS_OPTIONS, TrainConfig
from grpo_kernels.yaml_files import load_yaml


def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` -> the comment on its line and the comment lines right below it (its help);
    `# ---- ...` lines head sections and belong to no field."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {  # line -> (comment text, alone on its line)
        token.start[0]: (token.string.lstrip("#").strip(), not token.line[: token.start[1]].strip())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = node.end_lineno
            text, alone = comments.get(line, ("", False))
            parts = [] if alone else [text]
            while line + 1 in comments and comments[line + 1][1] and not comments[line + 1][0].startswith("----"):
                line += 1
                parts.append(comments[line][0])
            docs[node.target.id] = " ".join(p for p in parts if p)
    return docs


def _converter(annotation: str):
    """A string -> value function for a field's annotation (`int`, `float | None`, `dict[str, Any]`, ...)."""
    parts = [p.strip() for p in annotation.split("|")]
    nullable = "None" in parts
    base = next(p for p in parts if p != "None")
    parse = {"int": int, "float": float, "str": str}.get(base, lambda text: load_yaml(text, "a YAML value"))

    def convert(text: str):
        if nullable and text.lower() in ("none", "null"):
            return None
        return parse(text)

    convert.__name__ = base.split("[")[0]  # argparse names the type in its errors
    return convert


_METAVARS = {"int": "N", "float": "X", "str": "TEXT", "dict": "YAML"}


def _add_field(parser, name: str, annotation: str, default: Any, doc: str, valid: Sequence[str] | None) -> None:
    flag = f"--{name.replace('_', '-')}"
    shown = "none" if default is None else default
    extra = f"; one of: {', '.join(valid)}" if valid else ""
    help_text = f"{doc} (default: {shown}{extra})".replace("%", "%%")
    base = annotation.split("|")[0].strip().split("[")[0]
    kwargs: dict[str, Any] = dict(dest=name)
    if annotation in ("bool", "bool | None"):
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=_converter(annotation), metavar=_METAVARS.get(base, "VALUE"))
    parser.add_argument(flag, help=help_text, **kwargs)
    if "_" in name:  # the field's own spelling (and --no-<field> for a bool) works too, unlisted
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS, **kwargs)


DESCRIPTION = """\
GRPO with the fused kernels. No arguments: the embedded CPU demo (a tiny Llama learns single-digit addition from
reward alone). A run lives in --output-dir: config.yaml, metrics.jsonl, metrics.png, checkpoints/. A new run needs
an empty or absent directory (--overwrite clears it); --resume continues the run there with its own config.yaml, of
which only where it stops and how it logs may change (--steps, --checkpoint-every, --eval-every, --progress-every,
...). Option values: none for None; the loss options are those of grpo_kernels.LossOptions. Errors are one line
(--debug shows the traceback)."""

EPILOG = """\
examples:
  python -m grpo_kernels.train --preset dapo --output-dir runs/dapo --steps 100
  python -m grpo_kernels.train --preset dapo --paper-settings --learning-rate 1e-3
  python -m grpo_kernels.train --output-dir runs/dapo --resume --steps 200
  python -m grpo_kernels.train --dataset countdown --config my_run.yaml"""


TRUNCATION = ("top_k", "top_p", "min_p")  # in the trainer, the sampler's truncation too
TRUNCATES_BOTH = "; here it truncates both the rollouts' sampling (hf and vllm) and the log-probs (docs/trainer.md)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m grpo_kernels.train",
        usage="%(prog)s [options]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only the flags given come back, so they override preset and YAML
    )
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="YAML",
        help="a YAML file of TrainConfig fields (loss options under loss:)",
    )
    valid = {
        **choices(),
        "preset": [*presets.available(), "none", "a preset YAML file"],
        "device": ["auto", "cpu", "cuda", "cuda:N"],
        "dataset": ["addition", "countdown", "gsm8k", "a .jsonl path"],
    }
    train_fields = parser.add_argument_group("trainer options (TrainConfig fields)")
    defaults, docs = TrainConfig(), field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in NOT_CLI:
            _add_field(train_fields, f.name, f.type, getattr(defaults, f.name), docs[f.name], valid.get(f.name))
    loss_fields = parser.add_argument_group("loss options (LossOptions fields; defaults: the grpo preset's)")
    taken = {f.name for f in dataclasses.fields(TrainConfig)}
    loss_docs = field_docs(LossOptions)
    for f in dataclasses.fields(LossOptions):
        if f.name not in PER_STEP_LOSS_OPTIONS and f.name not in taken:
            default, doc = getattr(defaults.loss, f.name), loss_docs.get(f.name, "")
            if f.name in TRUNCATION:
                doc += TRUNCATES_BOTH
            _add_field(loss_fields, f.name, f.type, default, doc, valid.get(f.name))
    return parser

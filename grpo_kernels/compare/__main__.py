"""`python -m grpo_kernels.compare --presets grpo,dapo,... --steps 300 [trainer flags]`: train each preset on one
task with the same seed and budget, then write `compare.md` (the table), `compare.json` (the table, the reward
curves and the setup) and `compare.svg` (the reward curves) in `--output-dir`, next to one run directory per preset.

Flags it does not know go to every run's trainer (`--dataset countdown`, `--num-generations 8`, ...; see
`python -m grpo_kernels.train --help`). A user error is one line, `error: ...`, exit status 2, before any run.
The results are rewritten after each run; Ctrl-C or SIGTERM stops the current run and leaves the results of those
that finished (the stopped one marked interrupted), and `--resume --output-dir DIR` continues from there."""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from grpo_kernels.trainer import atomic_write, cli
from grpo_kernels.trainer.run_names import new_run_dir

DEFAULT_PRESETS = "grpo,dapo,dr_grpo,gspo,cispo,sapo,gpg,rloo"
RESULTS = ("compare.md", "compare.json", "compare.svg")

DESCRIPTION = """\
Train several paper presets on one task with the same seed and budget and compare them: one table (final reward,
steps to a reward threshold, greedy accuracy, tokens/s, peak memory) in compare.md and compare.json, and the reward
curves in compare.svg, in --output-dir; each run in its own subdirectory <output-dir>/<preset>/ (its log:
<output-dir>/<preset>.log). Every run gets the same group size, prompts per step, generation budget, learning rate,
updates per batch and temperature (the trainer's defaults or the trainer flags given) unless --paper-settings.
Other flags are trainer flags, given to every run."""


def build_parser() -> cli.Parser:
    parser = cli.Parser(
        prog="python -m grpo_kernels.compare",
        description=DESCRIPTION,
        allow_abbrev=False,
        epilog="example: python -m grpo_kernels.compare --presets grpo,dapo,gspo --steps 300 --output-dir runs/cmp",
    )
    parser.add_argument("--presets", default=DEFAULT_PRESETS, help=f"comma-separated (default: {DEFAULT_PRESETS})")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run (default: 300)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every run (default: 0)")
    parser.add_argument("--output-dir", help="new or empty directory (default: a new runs/compare-<timestamp>)")
    parser.add_argument("--overwrite", action="store_true", help="clear a non-empty --output-dir first")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the comparison in --output-dir with its own settings: keep its finished runs, resume the rest",
    )
    parser.add_argument("--threshold", type=float, default=0.8, help="reward of the 'steps to' column (default: 0.8)")
    parser.add_argument("--window", type=int, default=10, help="steps in the reward's moving mean (default: 10)")
    parser.add_argument(
        "--paper-settings", action="store_true", help="each preset's own training settings instead of shared ones"
    )
    parser.add_argument("--title", default=None, help="the plot's and the table's title")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_compare, argv)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _compare(argv: Sequence[str]) -> None:
    from grpo_kernels.compare.report import markdown_table, write_json
    from grpo_kernels.compare.runs import CompareConfig, compare, run_configs, saved_config, setup
    from grpo_kernels.compare.svg import reward_plot

    parser = build_parser()
    args, train_args = parser.parse_known_args(argv)
    saved: dict = {}
    if args.resume and not args.output_dir:
        raise ValueError("--resume needs --output-dir: the directory of the comparison to continue")
    if args.resume:
        given = [k for k, v in vars(args).items() if v != parser.get_default(k) and k not in ("resume", "output_dir")]
        if given or train_args:
            flags = ", ".join([*("--" + k.replace("_", "-") for k in given), *train_args])
            raise ValueError(f"--resume continues the comparison with its own settings: drop {flags}")
        config, saved = saved_config(args.output_dir)
    else:
        config = CompareConfig(
            presets=tuple(p.strip() for p in args.presets.split(",") if p.strip()),
            steps=args.steps,
            seed=args.seed,
            output_dir=args.output_dir or new_run_dir("compare"),
            overwrite=args.overwrite,
            threshold=args.threshold,
            window=args.window,
            paper_settings=args.paper_settings,
            train_args=tuple(train_args),
        )
    configs = run_configs(config)  # every error before the first run
    first = next(iter(configs.values()))
    title = args.title or f"{len(configs)} presets on {first.dataset}, {config.steps} steps, seed {config.seed}"
    print(f"compare: {title}; output {config.output_dir}", flush=True)
    out = Path(config.output_dir)
    info = setup(config, configs)
    info.update(
        started=saved.get("started", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
        command=saved.get("command", "python -m grpo_kernels.compare " + shlex.join(argv)),
    )

    def write(rows) -> None:
        write_json(out / RESULTS[1], rows, info)
        curves = {r.preset: r.curve for r in rows if r.error is None}
        reward_plot(curves, out / RESULTS[2], title=title, window=config.window)
        table = markdown_table(rows, config.threshold)
        text = f"# {title}\n\n`{info['command']}` (started {info['started']})\n\n{table}\n\n"
        atomic_write.write_text(out / RESULTS[0], text + f"![reward curves]({RESULTS[2]})\n")

    previous = signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: stop the current run, keep what finished
    try:
        rows = compare(config, log=lambda line: print(line, flush=True), write=write)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(markdown_table(rows, config.threshold))
    print(f"results: {', '.join(str(out / name) for name in RESULTS)}", flush=True)
    errors = [r.preset for r in rows if r.error is not None]
    if errors:
        failed = f"{len(errors)} of {len(rows)} runs failed ({', '.join(errors)})"
        raise ValueError(f"{failed}: see the table and their logs")


if __name__ == "__main__":
    main(sys.argv[1:])

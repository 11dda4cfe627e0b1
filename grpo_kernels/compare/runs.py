"""The runs of a comparison: one trainer configuration per preset (the trainer's own parser, so every trainer flag
works and is checked before any run starts), each trained in a fresh process in `<output_dir>/<preset>/`.

Same seed and budget: every run gets the same `steps`, `seed` and, unless `paper_settings`, the same `SHARED`
settings (group size, prompts per step, generation budget, learning rate, updates per batch, sampling
temperature: the trainer's defaults, or the values given as trainer flags), so that only the algorithm differs
(loss, advantage, rewards, sampler, regularizers). A run's own process makes its peak memory its own; its output
goes to `<output_dir>/<preset>.log`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import shutil
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

from grpo_kernels.compare.report import RunSummary, failed, summarize
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.cli import one_line
from grpo_kernels.trainer.config import TrainConfig, build_parser, parse_args

PROG = "python -m grpo_kernels.compare"
SHARED = ("num_generations", "prompts_per_step", "max_completion_length", "learning_rate", "num_iterations")
SHARED_LOSS = ("temperature",)
OWN = (
    "preset",
    "output_dir",
    "steps",
    "seed",
    "resume",
    "overwrite",
    "start_if_no_checkpoint",
    "paper_settings",
)  # compare's flags
RUN_DEFAULTS = ("--eval-every", "0", "--checkpoint-every", "0", "--no-plot")  # greedy eval and a checkpoint at the end


@dataclass(frozen=True)
class CompareConfig:
    """What `compare` runs: `presets` on the task the trainer flags `train_args` name, `steps` each, one `seed`."""

    presets: tuple[str, ...]
    steps: int = 300
    seed: int = 0
    output_dir: str = "runs/compare"
    overwrite: bool = False  # clear a non-empty output_dir first (else it is an error)
    threshold: float = 0.8  # the reward of the "steps to" column
    window: int = 10  # steps in the moving mean of the reward (final reward, steps to threshold, plot)
    paper_settings: bool = False  # each preset's own SHARED settings instead of one for all
    train_args: tuple[str, ...] = field(default_factory=tuple)  # other trainer flags, the same for every run


def run_configs(config: CompareConfig) -> dict[str, TrainConfig]:
    """Each preset's trainer configuration, checked (a ValueError / TypeError naming the bad option)."""
    if not config.presets:
        raise ValueError("presets must name at least one preset, e.g. --presets grpo,dapo")
    repeated = sorted({p for p in config.presets if config.presets.count(p) > 1})
    if repeated:
        raise ValueError(f"presets must differ, got {repeated} more than once")
    if config.steps < 1:
        raise ValueError(f"steps must be >= 1, got {config.steps}")
    if config.window < 1:
        raise ValueError(f"window must be >= 1, got {config.window}")
    parser = build_parser()
    parser.prog = PROG
    given = vars(parser.parse_args(list(config.train_args)))  # only the flags given (the parser's default: absent)
    own = [name for name in OWN if name in given]
    if own:
        flags = ", ".join("--" + name.replace("_", "-") for name in own)
        raise ValueError(f"{flags}: set by compare for each run (use compare's own --presets, --steps, --seed, ...)")
    shared = ["--paper-settings"] if config.paper_settings else _shared_flags()
    configs = {}
    for preset in config.presets:
        if "/" in preset or preset in (".", ".."):
            raise ValueError(f"presets must be preset names (each names a subdirectory), got {preset!r}")
        run = [*RUN_DEFAULTS, *shared, "--preset", preset, "--steps", str(config.steps), "--seed", str(config.seed)]
        out = str(Path(config.output_dir) / preset)
        configs[preset] = parse_args([*run, *config.train_args, "--output-dir", out])
    return configs


def _shared_flags() -> list[str]:
    """The trainer's defaults of the SHARED settings as flags (flags given later override them)."""
    defaults, loss = TrainConfig(), LossOptions()
    values = {**{n: getattr(defaults, n) for n in SHARED}, **{n: getattr(loss, n) for n in SHARED_LOSS}}
    return [a for n, v in values.items() for a in ("--" + n.replace("_", "-"), "none" if v is None else str(v))]


def prepare_output(config: CompareConfig) -> Path:
    """`output_dir`, absent or empty (cleared first with `overwrite`), so that no run mixes with another's files."""
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {str(out)!r} is a file: --output-dir needs a directory (new or empty)")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if entries and not config.overwrite:
        names = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(
            f"output_dir {str(out)!r} is not empty ({names}): a comparison does not write into other runs' files; "
            "--overwrite replaces its contents, or choose another --output-dir"
        )
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def compare(config: CompareConfig, *, log=print) -> list[RunSummary]:
    """Train each preset in turn (a fresh process each) and summarise it; `log` gets one line per run."""
    configs = run_configs(config)
    out = prepare_output(config)
    rows = []
    for i, (preset, train_config) in enumerate(configs.items(), start=1):
        log_path = out / f"{preset}.log"
        row = run_one(preset, train_config, log_path, config.threshold, config.window)
        rows.append(row)
        log(f"[{i}/{len(configs)}] {progress_line(row, config.threshold)} (log: {log_path})")
    return rows


def progress_line(row: RunSummary, threshold: float) -> str:
    """What a finished run says: its main numbers, or its error."""
    if row.error is not None:
        return f"{row.preset}: failed: {row.error}"
    reached = "never" if row.steps_to_threshold is None else f"step {row.steps_to_threshold}"
    accuracy = "n/a" if row.greedy_accuracy is None else f"{row.greedy_accuracy:.3f}"
    return (
        f"{row.preset}: {row.steps} steps in {row.wall_seconds:.0f} s, final reward {row.final_reward:.3f}, "
        f"reward {threshold:g} {reached}, greedy accuracy {accuracy}"
    )


def run_one(preset: str, config: TrainConfig, log_path: Path, threshold: float, window: int) -> RunSummary:
    """Train `config` in a fresh process (its output in `log_path`) and summarise it."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_train_in_child, args=(config, str(log_path), send), daemon=True)
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        process.join()
        result = ("error", f"the run's process ended without a result (exit code {process.exitcode})")
    process.join()
    if result[0] == "error":
        return failed(preset, result[1])
    _, history, tokens, peak, wall = result
    return summarize(
        preset, history, tokens, threshold=threshold, window=window, peak_memory_bytes=peak, wall_seconds=wall
    )


def _train_in_child(config: TrainConfig, log_path: str, send) -> None:
    """The run's process: train, then send (history, tokens per step, peak memory in bytes, wall seconds)."""
    with open(log_path, "w", encoding="utf-8") as log, redirect_stdout(log), redirect_stderr(log):
        tic = time.perf_counter()
        try:
            trainer = _counting_trainer(config)
            history = trainer.train()
            wall = time.perf_counter() - tic
            send.send(("ok", history, trainer.tokens, _peak_memory(trainer.parallel.device), wall))
        except Exception as error:  # the parent reports it as the run's row; the traceback stays in the log
            traceback.print_exc()
            send.send(("error", one_line(error)))


def _counting_trainer(config: TrainConfig):
    """A GRPOTrainer that also records the completion tokens it trains on at each step."""
    from grpo_kernels.trainer.train import GRPOTrainer

    class CountingTrainer(GRPOTrainer):
        def advantages(self, step, old_logp, entropy):
            self.tokens.append(int(step.batch.completion_mask.sum()))
            return super().advantages(step, old_logp, entropy)

    trainer = CountingTrainer(config)
    trainer.tokens = []
    return trainer


def _peak_memory(device) -> int:
    """Peak bytes: CUDA's max allocated on a GPU run, else this process's peak resident set."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def setup(config: CompareConfig, configs: dict[str, TrainConfig]) -> dict:
    """What the runs shared, for the JSON file and the markdown header."""
    first = next(iter(configs.values()))
    data = dataclasses.asdict(config)
    keys = ("dataset", "model", "hidden_size", "num_layers", "num_heads", "device", "torch_threads", *SHARED)
    data["trainer"] = {k: getattr(first, k) for k in keys}
    data["trainer"]["temperature"] = first.loss.temperature
    data["runs"] = {
        preset: {
            "loss_type": c.loss.loss_type,
            "advantage": c.advantage,
            **{k: getattr(c, k) for k in SHARED},
            "temperature": c.loss.temperature,
        }
        for preset, c in configs.items()
    }
    return data

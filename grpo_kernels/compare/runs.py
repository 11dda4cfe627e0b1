"""The runs of a comparison: one trainer configuration per preset (the trainer's own parser, so every trainer flag
works and is checked before any run starts), each trained in a fresh process in `<output_dir>/<preset>/`.

Same seed and budget: every run gets the same `steps`, `seed` and, unless `paper_settings`, the same `SHARED`
settings (group size, prompts per step, generation budget, learning rate, updates per batch, sampling
temperature: the trainer's defaults, or the values given as trainer flags), so that only the algorithm differs
(loss, advantage, rewards, sampler, regularizers). A run's own process makes its peak memory its own; its output
goes to `<output_dir>/<preset>.log`.

Nothing finished is lost: the results are rewritten after every run, and an interrupt (Ctrl-C, SIGTERM) stops the
current run's process and writes them with that run marked interrupted. `resume` continues the comparison in its
`output_dir` with its own settings (`compare.json`): finished runs are kept, the others run with the trainer's
`--resume --start-if-no-checkpoint` (from their last checkpoint, where `--checkpoint-every` wrote one).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

from grpo_kernels import presets
from grpo_kernels.compare.report import INTERRUPTED, RunSummary, failed, summarize
from grpo_kernels.options import LossOptions
from grpo_kernels.shown import shown
from grpo_kernels.trainer import run_lock
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
RESULTS_JSON = "compare.json"  # the results file, which `resume` reads


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
    resume: bool = False  # continue the comparison in output_dir: keep its finished runs, resume the others


def saved_config(output_dir: str) -> tuple[CompareConfig, dict]:
    """The comparison in `output_dir` (its `compare.json`: settings and setup) to resume, with `resume` set."""
    path = Path(output_dir) / RESULTS_JSON
    if not path.is_file():
        raise ValueError(f"--resume: {str(path)!r} does not exist, so {output_dir!r} holds no comparison to continue")
    try:
        setup = json.loads(path.read_text(encoding="utf-8"))["setup"]
        names = [f.name for f in dataclasses.fields(CompareConfig) if f.name not in ("resume", "output_dir")]
        values = {n: tuple(setup[n]) if isinstance(setup[n], list) else setup[n] for n in names}
        return CompareConfig(**values, output_dir=output_dir, resume=True), setup
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"--resume: {path}: not the results of a comparison ({shown(error)})") from None


def finished_runs(output_dir: str) -> dict[str, RunSummary]:
    """The runs of `output_dir`'s `compare.json` that finished (no error), by preset, each row checked (a ValueError
    naming the row and the field)."""
    path = Path(output_dir) / RESULTS_JSON
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"--resume: {path}: not the results of a comparison ({shown(error)})") from None
    if not isinstance(runs, list):
        raise ValueError(f"--resume: {path}: 'runs' must be a list of rows, got {shown(runs)}")
    rows = [_row(run, i, path) for i, run in enumerate(runs)]
    return {row.preset: row for row in rows if row.error is None}


_ROW_TYPES = {"preset": str, "steps": int, "error": (str, type(None)), "curve": list}


def _row(run: object, index: int, path: Path) -> RunSummary:
    """Row `index` of compare.json as a RunSummary, or a ValueError naming what is wrong with it."""
    where = f"--resume: {path}: run row {index}"
    if not isinstance(run, dict):
        raise ValueError(f"{where} must be an object, got {shown(run)}")
    names = [f.name for f in dataclasses.fields(RunSummary)]
    missing = [n for n in names if n not in run]
    unknown = [n for n in run if n not in names]
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {shown(missing)}, unknown fields {shown(unknown)}")
    for name, kinds in _ROW_TYPES.items():
        if not isinstance(run[name], kinds) or isinstance(run[name], bool):
            raise ValueError(f"{where}: {name} must be {kinds}, got {shown(run[name])}")
    numbers = [n for n in names if n not in _ROW_TYPES]
    bad = [
        n
        for n in numbers
        if not (run[n] is None or (isinstance(run[n], (int, float)) and not isinstance(run[n], bool)))
    ]
    if bad:
        raise ValueError(f"{where}: {bad[0]} must be a number or null, got {shown(run[bad[0]])}")
    points = run["curve"]
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p) for p in points):
        raise ValueError(f"{where}: curve must be a list of [step, reward] pairs")
    return RunSummary(**{**run, "curve": [tuple(point) for point in points]})


def run_configs(config: CompareConfig) -> dict[str, TrainConfig]:
    """Each preset's trainer configuration, checked (a ValueError / TypeError naming the bad option)."""
    if not config.presets:
        raise ValueError("presets must name at least one preset, e.g. --presets grpo,dapo")
    folded = [p.lower() for p in config.presets]  # shipped names in any case; run directories differ in any case
    repeated = sorted({p for p in config.presets if folded.count(p.lower()) > 1})
    if repeated:
        raise ValueError(f"presets must differ (in any case), got {shown(repeated)}")
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
            raise ValueError(f"presets must be preset names (each names a subdirectory), got {shown(preset)}")
        preset = preset.lower() if preset.lower() in presets.available() else preset
        run = [*RUN_DEFAULTS, *shared, "--preset", preset, "--steps", str(config.steps), "--seed", str(config.seed)]
        run += ["--resume", "--start-if-no-checkpoint"] if config.resume else []
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
    entries = sorted(p for p in out.iterdir() if p.name != run_lock.LOCK_FILE) if out.is_dir() else []
    names = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
    holds_comparison = (out / RESULTS_JSON).is_file()
    if entries and not config.overwrite:
        advice = "--overwrite replaces its contents, " if holds_comparison else ""
        raise ValueError(
            f"output_dir {str(out)!r} is not empty ({names}): a comparison does not write into other runs' files; "
            f"{advice}or choose another --output-dir"
        )
    if entries and (out.is_symlink() or not holds_comparison):
        what = "is a symlink" if out.is_symlink() else f"holds no comparison ({RESULTS_JSON}; it holds {names})"
        raise ValueError(
            f"--overwrite: output_dir {str(out)!r} {what}, so it is not cleared: choose another --output-dir"
        )
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return out


def compare(config: CompareConfig, *, log=print, write=lambda rows: None) -> list[RunSummary]:
    """Train each preset in turn (a fresh process each) and summarise it; `log` gets one line per run, `write` the
    rows so far after each. An interrupt stops the current run, `write`s the rows with it marked interrupted, and
    raises KeyboardInterrupt saying so (with `resume`: the runs that finished before are kept, not run again)."""
    configs = run_configs(config)
    run_lock.claim(config.output_dir)
    try:
        return _compare_claimed(config, configs, log, write)
    finally:
        run_lock.release(config.output_dir)


def _compare_claimed(config: CompareConfig, configs: dict[str, TrainConfig], log, write) -> list[RunSummary]:
    out = Path(config.output_dir) if config.resume else prepare_output(config)
    done = finished_runs(config.output_dir) if config.resume else {}
    for train_config in configs.values() if config.resume else ():
        pid = run_lock.holder(train_config.output_dir)
        if pid is not None:
            raise ValueError(
                f"--resume: run {train_config.output_dir!r} is still in use by process {pid} (a run of the earlier "
                "compare, still going): wait for it to end, or stop it, then --resume"
            )
    rows: list[RunSummary] = []
    write(rows)  # from the start: a comparison stopped in any way can be resumed
    for i, (preset, train_config) in enumerate(configs.items(), start=1):
        log_path = out / f"{preset}.log"
        if preset in done:
            rows.append(done[preset])
            log(f"[{i}/{len(configs)}] {preset}: finished before, kept")
            continue
        try:
            row = run_one(preset, train_config, log_path, config.threshold, config.window)
        except KeyboardInterrupt:
            write([*rows, failed(preset, INTERRUPTED)])
            finished = f"{len(rows)} of {len(configs)} runs finished, {preset} interrupted"
            resume = f"python -m grpo_kernels.compare --resume --output-dir {config.output_dir} continues"
            raise KeyboardInterrupt(f"{finished}; results in {out / RESULTS_JSON} and beside it; {resume}") from None
        rows.append(row)
        write(rows)
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
    args = (config, str(log_path), send, os.getpid())
    process = context.Process(target=_train_in_child, args=args, daemon=True)
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        process.join()
        result = ("error", f"the run's process ended without a result (exit code {process.exitcode})")
    except KeyboardInterrupt:  # the run stops (SIGTERM; a checkpoint write is atomic) before the comparison does
        process.terminate()
        process.join()
        raise
    process.join()
    if result[0] == "error":
        return failed(preset, result[1])
    _, history, tokens, peak, wall = result
    return summarize(
        preset, history, tokens, threshold=threshold, window=window, peak_memory_bytes=peak, wall_seconds=wall
    )


def _train_in_child(config: TrainConfig, log_path: str, send, parent: int) -> None:
    """The run's process: train, then send (history, tokens per step, peak memory in bytes, wall seconds). Ctrl-C
    is the parent's to handle: it stops this process. It dies with its parent, however that ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stop_with_parent(parent)
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
        except KeyboardInterrupt as stop:  # SIGTERM (from the parent, or at its death): stopped at a step boundary
            print(f"interrupted: {one_line(stop)}", flush=True)


def _stop_with_parent(parent: int) -> None:
    """SIGTERM when the parent process dies, even by SIGKILL (Linux's parent-death signal): the run then stops at
    its next step boundary with a checkpoint, and releases its directory. Elsewhere nothing is set."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


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

"""Metrics: one JSON line per step (always), a start line, progress, a summary table and a PNG of the curves.

Progress is a live bar in a terminal, and a plain line every `progress_every` steps or `progress_seconds` seconds
otherwise (output redirected to a file, a batch job), so a log shows the run advancing. The progress bar and the
table use `rich` when it is installed, else `tqdm` (a transformers dependency) and plain text; the plot needs
`matplotlib` (skipped with a note otherwise). A run that does not resume starts a new JSONL; on resume the JSONL
keeps the lines up to the checkpoint's step and appends after them.
"""

from __future__ import annotations

import errno
import io
import json
import os
import sys
import time
from pathlib import Path

from grpo_kernels.shown import shown
from grpo_kernels.trainer import atomic_write

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
LIVE = ("reward", "rewards/answer", "kl", "entropy")  # shown in the progress bar
SUMMARY = ("reward", "rewards/answer", "rewards/closeness", "rewards/format", "eval/answer", "kl", "entropy")
PLOTS = (("reward", "rewards/answer", "eval/answer"), ("kl",), ("entropy",), ("completion_length",))


class MetricsWriteError(OSError):
    """The file system refused a line of `metrics.jsonl` (no space left, ...); the file keeps its whole lines."""

    def __str__(self) -> str:
        return self.strerror


def append_line(path: Path, line: str) -> None:
    """Append `line` to `path` in one write; a failed or short write (a full disk) is cut off again, so the file
    never ends in part of a line, and is a `MetricsWriteError` naming the file."""
    data = line.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            failure = None if written == len(data) else errno.ENOSPC  # a short write: the disk filled up
        except OSError as error:
            failure = error.errno or errno.EIO
        if failure is not None:
            os.ftruncate(fd, size)
            raise MetricsWriteError(
                failure,
                f"{os.strerror(failure).lower()} while writing {path} (errno {errno.errorcode.get(failure, failure)}; "
                "it keeps its whole lines, up to the previous step): free space, then --resume continues from the "
                "latest checkpoint",
            )
    finally:
        os.close(fd)


def start_line(config, step: int, resumed_from: Path | None, config_file: Path) -> str:
    """The line a run starts with: the run (its directory's name), what it trains, and where it writes."""
    run = f"GRPO run {Path(config.output_dir).name!r}"
    where = f"resuming from {resumed_from} (step {step})" if resumed_from is not None else "from step 0"
    return (
        f"{run}, {where} to step {config.steps}: preset {config.preset or 'none'} (loss_type {config.loss.loss_type}, "
        f"beta {config.loss.beta:g}), model {config.model}, dataset {config.dataset}, seed {config.seed}; "
        f"config {config_file}, output {config.output_dir}"
    )


def read_metrics(output_dir: str | Path) -> list[dict]:
    """The records of `<output_dir>/metrics.jsonl`; a last line cut short (a run killed while writing) is dropped."""
    path = Path(output_dir) / METRICS_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records


class MetricsLogger:
    """Writes `metrics.jsonl` under `output_dir`; with `progress`, a live bar of reward / accuracy / KL / entropy;
    without a terminal, a progress line every `progress_every` steps or `progress_seconds` seconds (0: never);
    with `report_to` ("tensorboard", "wandb"), the same records there. `write=False` (ranks other than 0 under
    torchrun) keeps the history and writes nothing."""

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        write: bool = True,
        report_to: str = "none",
        run_config: dict | None = None,
        progress_every: int = 50,
        progress_seconds: float = 60.0,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.history = [m for m in read_metrics(self.output_dir) if m["step"] <= start_step]
        self.path = self.output_dir / METRICS_FILE if write else None
        if self.path is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # a resumed run keeps the lines up to its step: rewritten whole, never truncated in place
            atomic_write.write_text(self.path, "".join(json.dumps(m) + "\n" for m in self.history))
        self.start_time = time.perf_counter()
        self.start_step, self.total_steps = start_step, total_steps
        self.bar = None
        if progress and write:
            terminal = sys.stdout.isatty()
            self.bar = (
                _Bar(total_steps, start_step) if terminal else _Lines(total_steps, progress_every, progress_seconds)
            )
        self.tracker = tracker(report_to, self.output_dir, run_config or {}) if write else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.history.append(record)
        if self.path is not None:
            append_line(self.path, json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(step, metrics)
        if self.bar is not None:
            self.bar.update({k.split("/")[-1]: metrics[k] for k in LIVE if k in metrics}, step)

    def stop(self) -> None:
        """Stop the bar and the tracker (a run interrupted, or at its end)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def close(self, plot: bool = True) -> str:
        """Stop the bar, print the summary table, write the plot; returns the table's text."""
        self.stop()
        wall = time.perf_counter() - self.start_time
        table = summary_table(self.history, wall, self.total_steps - self.start_step)
        if self.path is None:
            return table
        print(table)
        if plot:
            print(plot_metrics(self.history, self.output_dir / PLOT_FILE))
        return table


def summary_table(history: list[dict], wall_seconds: float, steps_run: int) -> str:
    """First, last and best value of the main metrics (best: the highest, for rewards and accuracies only), wall
    time; rendered by rich when installed."""
    rows = []
    for name in SUMMARY:
        values = [m[name] for m in history if name in m]
        if values:
            best = f"{max(values):.3f}" if "reward" in name or name.startswith("eval/") else ""
            rows.append((name, f"{values[0]:.3f}", f"{values[-1]:.3f}", best))
    caption = f"{steps_run} steps in {wall_seconds:.0f} s ({wall_seconds / max(steps_run, 1):.2f} s/step)"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        lines = [f"{'metric':<20}{'first':>10}{'last':>10}{'best':>10}"] + [
            f"{r[0]:<20}{r[1]:>10}{r[2]:>10}{r[3]:>10}" for r in rows
        ]
        return "\n".join([*lines, caption])
    table = Table(title="GRPO run summary", caption=caption)
    for column in ("metric", "first", "last", "best"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in rows:
        table.add_row(*row)
    text = io.StringIO()
    Console(file=text, width=100).print(table)
    return text.getvalue()


def plot_metrics(history: list[dict], path: Path) -> str:
    """PNG of the curves in PLOTS against the step; returns a line saying where it went (or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: pip install matplotlib"
    fig, axes = plt.subplots(1, len(PLOTS), figsize=(4 * len(PLOTS), 3.2))
    for ax, names in zip(axes, PLOTS, strict=True):
        for name in names:
            points = [(m["step"], m[name]) for m in history if name in m]
            if points:
                ax.plot(*zip(*points, strict=True), label=name, marker="." if name.startswith("eval") else None)
        ax.set_xlabel("step")
        ax.set_title(" / ".join(names) if len(names) == 1 else "reward and accuracy")
        if len(names) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_write.replacing(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


REPORT_TO = ("none", "tensorboard", "wandb")


def tracker(report_to: str, output_dir: Path, run_config: dict):
    """The experiment tracker `report_to` names, or None for "none"; a clear error when its package is missing."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to must be one of {REPORT_TO}, got {shown(report_to)}")
    if report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("report_to='tensorboard' needs tensorboard: pip install tensorboard") from error
        return _TensorBoard(SummaryWriter(log_dir=str(output_dir / "tensorboard")))
    if report_to == "wandb":
        try:
            import wandb
        except ImportError as error:
            raise ImportError("report_to='wandb' needs wandb: pip install 'grpo-kernels[wandb]'") from error
        return _WandB(wandb.init(project="grpo-kernels", dir=str(output_dir), config=run_config))
    return None


class _TensorBoard:
    def __init__(self, writer) -> None:
        self.writer = writer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run) -> None:
        self.run = run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Bar:
    """A progress bar with live metric fields: rich's, else tqdm's."""

    def __init__(self, total: int, done: int) -> None:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        except ImportError:
            from tqdm import tqdm

            self.rich, self.bar = None, tqdm(total=total, initial=done, desc="GRPO")
            return
        self.rich = Progress(
            TextColumn("GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[live]}"),
        )
        self.rich.start()
        self.bar = self.rich.add_task("train", total=total, completed=done, live="")

    def update(self, live: dict[str, float], step: int) -> None:
        text = " ".join(f"{k}={v:.3f}" for k, v in live.items())
        if self.rich is None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            self.rich.update(self.bar, advance=1, live=text)

    def close(self) -> None:
        if self.rich is None:
            self.bar.close()
        else:
            self.rich.stop()


class _Lines:
    """Progress without a terminal: one line every `every` steps or `seconds` seconds (whichever comes first; 0
    turns either off), and at the last step."""

    def __init__(self, total: int, every: int, seconds: float) -> None:
        self.total, self.every, self.seconds = total, every, seconds
        self.start = self.last = time.perf_counter()
        self.steps = 0

    def update(self, live: dict[str, float], step: int) -> None:
        now = time.perf_counter()
        self.steps += 1
        due = (self.every and step % self.every == 0) or (self.seconds and now - self.last >= self.seconds)
        if not (due or step == self.total):
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / self.steps * (self.total - step)
        values = " ".join(f"{k}={v:.3f}" for k, v in live.items())
        print(f"step {step}/{self.total} {values} ({elapsed:.0f} s, about {left:.0f} s left)", flush=True)

    def close(self) -> None:
        pass

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
from grpo_kernels.trainer.sampler_sync import IS_RATIO, KEPT_MASS, LOGP_DIFFERENCE

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
GAP = f"{LOGP_DIFFERENCE}/mean"  # the sampler-sync guard's reading
# shown in the progress bar, by label; the sampler's where the run logs them (the kept mass: truncated sampling)
LIVE = {"reward": "reward", "rewards/answer": "answer", "kl": "kl", "entropy": "entropy", KEPT_MASS: "kept_mass"}
LIVE_SAMPLER = {GAP: "sampler_gap"}
SUMMARY = ("reward", "rewards/answer", "rewards/closeness", "rewards/format", "eval/answer", "kl", "entropy")
SUMMARY_SAMPLER = {KEPT_MASS: "kept_mass", f"{IS_RATIO}/mean": "is_ratio", GAP: "sampler_gap"}
PHASES = ("generation", "scoring", "old_logp_pass", "reference_pass", "update")  # each step's `time/<phase>`, s
TIMES = ("step_time", *(f"time/{phase}" for phase in PHASES))  # the metrics that differ between identical runs
PLOTS = (("reward", "rewards/answer", "eval/answer"), ("kl",), ("entropy",), ("completion_length",))
SAMPLER_PLOT = ((f"{IS_RATIO}/mean", KEPT_MASS), (GAP,))  # the sampler's panel: ratios on the left, the gap right


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
            live = {label: metrics[k] for k, label in {**LIVE, **LIVE_SAMPLER}.items() if k in metrics}
            self.bar.update(live, step, lambda: phase_times(self.history[len(self.history) - self.bar.steps :]))

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
    """First, last and best value of the main metrics (best: the highest, for rewards and accuracies only), and of
    the sampler's where the run logs them (kept mass, importance ratio, the guard's gap); wall time; the phases'
    mean times per step; rendered by rich when installed."""
    rows = []
    for name, label in [*((n, n) for n in SUMMARY), *SUMMARY_SAMPLER.items()]:
        values = [m[name] for m in history if name in m]
        if values:
            best = f"{max(values):.3f}" if "reward" in name or name.startswith("eval/") else ""
            rows.append((label, number(values[0]), number(values[-1]), best))
    caption = f"{steps_run} steps in {wall_seconds:.0f} s ({wall_seconds / max(steps_run, 1):.2f} s/step)"
    phases = phase_times(history[len(history) - steps_run :] if steps_run > 0 else [])
    phases = f"per step: {phases}" if phases else ""  # a line below the table, too long for its caption
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        lines = [f"{'metric':<20}{'first':>10}{'last':>10}{'best':>10}"] + [
            f"{r[0]:<20}{r[1]:>10}{r[2]:>10}{r[3]:>10}" for r in rows
        ]
        return "\n".join([*lines, caption, phases]).rstrip("\n")
    table = Table(title="GRPO run summary", caption=caption)
    for column in ("metric", "first", "last", "best"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in rows:
        table.add_row(*row)
    text = io.StringIO()
    Console(file=text, width=100).print(table)
    return text.getvalue() + (f"{phases}\n" if phases else "")


def phase_times(history: list[dict]) -> str:
    """The mean seconds per step of each phase (`time/<phase>`) over the records of `history` that hold it, e.g.
    "generation 0.12 s, scoring 0.001 s, ..."; "" when none does."""
    parts = []
    for phase in PHASES:
        values = [m[f"time/{phase}"] for m in history if f"time/{phase}" in m]
        if values:
            parts.append(f"{phase.replace('_', ' ')} {sum(values) / len(values):.3g} s")
    return ", ".join(parts)


def number(value: float) -> str:
    """A metric as the progress and the summary show it: three decimals, or two significant digits below 1e-3 (the
    sampler's gap is ~1e-7 in fp32)."""
    return f"{value:.3f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.1e}"


def plot_metrics(history: list[dict], path: Path) -> str:
    """PNG of the curves in PLOTS against the step, and a sampler panel (importance ratio and kept mass, the guard's
    gap on a log scale) when the run logged them; returns a line saying where it went (or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: pip install matplotlib"
    sampler = any(GAP in m for m in history)
    panels = len(PLOTS) + sampler
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.2))
    for ax, names in zip(axes, PLOTS, strict=False):
        _curves(ax, history, names)
        ax.set_title(" / ".join(names) if len(names) == 1 else "reward and accuracy")
        if len(names) > 1:
            ax.legend(fontsize=7)
    if sampler:
        ratios, (gap,) = SAMPLER_PLOT
        _curves(axes[-1], history, ratios)
        right = axes[-1].twinx()
        _curves(right, history, (gap,), color="tab:red")
        right.set_yscale("log")
        right.set_ylabel("sampler gap (nats, log)", fontsize=7)
        axes[-1].set_title("sampler")
        axes[-1].legend(fontsize=7, loc="lower left")
        right.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    with atomic_write.replacing(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


def _curves(ax, history: list[dict], names, **style) -> None:
    """Each metric of `names` that `history` holds, against the step, on `ax`."""
    for name in names:
        points = [(m["step"], m[name]) for m in history if name in m]
        if points:
            marker = "." if name.startswith("eval") else None
            ax.plot(*zip(*points, strict=True), label=name.removeprefix("sampling/"), marker=marker, **style)
    ax.set_xlabel("step")


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
        self.steps = 0  # steps logged since the bar started
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

    def update(self, live: dict[str, float], step: int, phases=None) -> None:
        self.steps += 1
        text = " ".join(f"{k}={number(v)}" for k, v in live.items())
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

    def update(self, live: dict[str, float], step: int, phases=None) -> None:
        """`phases`: a function giving the mean phase times of the steps since the start (`phase_times`)."""
        now = time.perf_counter()
        self.steps += 1
        due = (self.every and step % self.every == 0) or (self.seconds and now - self.last >= self.seconds)
        if not (due or step == self.total):
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / self.steps * (self.total - step)
        values = " ".join(f"{k}={number(v)}" for k, v in live.items())
        per_step = phases() if phases is not None else ""
        per_step = f"; per step: {per_step}" if per_step else ""
        print(f"step {step}/{self.total} {values} ({elapsed:.0f} s, about {left:.0f} s left{per_step})", flush=True)

    def close(self) -> None:
        pass

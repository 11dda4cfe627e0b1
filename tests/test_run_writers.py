"""One writer per run directory, and rewrites that never lose what was there.

- A run holds its directory's lock (`trainer/run_lock.py`): a second `train`, `--resume` or `compare` there is one
  line naming the holder's PID; the lock goes with the process, however it ends.
- SIGTERM / Ctrl-C stop a real run at a step boundary with a checkpoint there and one line naming the step and the
  resume command.
- Default run names are claimed by creating the directory: two runs started in the same second get two.
- `config.yaml`, `metrics.jsonl` (on resume) and compare's results are replaced whole: a write cut short (here a
  file-size limit, EFBIG) leaves the old file as it was.
- `--overwrite` only replaces a directory that holds a run, and never through a symlink."""

import dataclasses
import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from grpo_kernels.compare.report import failed, write_json
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.__main__ import main as train_main
from grpo_kernels.trainer.checkpoint import checkpoint_dir, latest
from grpo_kernels.trainer.logging import TIMES, MetricsLogger, read_metrics
from grpo_kernels.trainer.run_dir import save_config
from grpo_kernels.trainer.run_names import new_run_dir
from grpo_kernels.trainer.train import GRPOTrainer
from tests.test_run_dir import run_main

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TINY_FLAGS = ["--prompts-per-step", "2", "--num-generations", "2", "--eval-every", "0", "--no-plot"]
TINY_FLAGS += ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2"]


def command(*args: str, capsys) -> tuple[int, str]:
    """(exit status, stderr) of `python -m grpo_kernels.train ARGS` run as its `main` in this process."""
    status, _, err = run_main(train_main, args, capsys)
    return status, err


def wait_for(condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_second_writer_is_refused_naming_the_pid_and_sigterm_stops_at_a_step_boundary(tmp_path, capsys):
    """Two runs on one --output-dir used to both exit 0 with their metrics interleaved; Ctrl-C / SIGTERM used to
    keep only the last periodic checkpoint (here: step 0, with --checkpoint-every 1000) without naming a step."""
    out = tmp_path / "run"
    flags = [*TINY_FLAGS, "--steps", "100000", "--checkpoint-every", "1000", "--progress-every", "1"]
    holder = subprocess.Popen(
        [sys.executable, "-m", "grpo_kernels.train", "--output-dir", str(out), *flags],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(read_metrics(out)) >= 2 or holder.poll() is not None)
        assert holder.poll() is None, holder.communicate()
        in_use = f"'{out}' is in use by process {holder.pid} "
        for again in (["--overwrite"], ["--resume"]):
            status, err = command("--output-dir", str(out), *TINY_FLAGS, "--steps", "3", *again, capsys=capsys)
            assert status == 2 and err.count("\n") == 1 and in_use in err, err
        holder.send_signal(signal.SIGTERM)
        _, err = holder.communicate(timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == 130, err
    last = err.strip().splitlines()[-1]  # the interruption's one line (library warnings may come before it)
    found = re.fullmatch(
        r"interrupted: SIGTERM: stopped after step (\d+) of 100000, checkpoint (\S+); continue: (.*)", last
    )
    assert found and "Traceback" not in err, err
    step = int(found.group(1))
    assert found.group(2) == str(checkpoint_dir(out, step)) and latest(out) == checkpoint_dir(out, step)
    assert found.group(3) == f"python -m grpo_kernels.train --output-dir {out} --resume"
    assert [m["step"] for m in read_metrics(out)] == list(range(1, step + 1))
    status, err = command("--output-dir", str(out), "--resume", "--steps", str(step + 1), "--no-plot", capsys=capsys)
    assert status == 0, err  # the lock went with the process
    assert [m["step"] for m in read_metrics(out)] == list(range(1, step + 2))


class _InterruptedAt(GRPOTrainer):
    """A trainer that receives SIGINT (Ctrl-C) in the middle of step `at`."""

    at = 2

    def advantages(self, step, old_logp, entropy):
        if self.step == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return super().advantages(step, old_logp, entropy)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT as in a terminal (Python's KeyboardInterrupt), whatever this process inherited: a shell's background
    job starts with SIGINT ignored, which the trainer leaves ignored."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def test_ctrl_c_mid_run_checkpoints_that_step_and_resumes_to_the_same_numbers(tmp_path, ctrl_c_raises):
    config = TrainConfig(progress=False, plot=False, checkpoint_every=0, steps=4, prompts_per_step=2)
    config = dataclasses.replace(config, num_generations=2, eval_every=0)
    straight = GRPOTrainer(dataclasses.replace(config, output_dir=str(tmp_path / "straight"))).train()
    out = tmp_path / "run"
    trainer = _InterruptedAt(dataclasses.replace(config, output_dir=str(out)))
    with pytest.raises(KeyboardInterrupt, match=r"^SIGINT: stopped after step 2 of 4, checkpoint .*step_000002;"):
        trainer.train()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    resumed = GRPOTrainer(dataclasses.replace(config, output_dir=str(out), resume=True))
    assert resumed.resumed_from == checkpoint_dir(out, 2)
    history = resumed.train()
    timeless = lambda h: [{k: v for k, v in m.items() if k not in TIMES} for m in h]  # noqa: E731
    assert timeless(history) == timeless(straight)


def test_default_run_names_are_claimed_atomically(tmp_path):
    """Two runs started in the same second used to get the same name (and one died with a raw [Errno 2])."""
    with ThreadPoolExecutor(8) as pool:
        names = list(pool.map(lambda _: new_run_dir("demo", tmp_path), range(16)))
    assert len(set(names)) == 16 and all(Path(n).is_dir() for n in names)


@contextmanager
def file_size_limit(size: int):
    """Writes past `size` bytes fail with EFBIG (SIGXFSZ ignored), as under `ulimit -f`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_rewrites_cut_short_leave_the_old_files_whole(tmp_path):
    """metrics.jsonl (kept lines, rewritten on resume), config.yaml and compare.json used to be truncated in place:
    a write cut short lost the metric lines or left a config.yaml the run could not resume from."""
    records = [{"step": s, "reward": 0.5, "pad": "x" * 200} for s in range(1, 201)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    config = tmp_path / "config.yaml"
    save_config(tmp_path, TrainConfig().to_dict())
    results = tmp_path / "compare.json"
    write_json(results, [failed("grpo", "x")], {"presets": ["grpo"]})
    before = {p: p.read_bytes() for p in (metrics, config, results)}
    limit = max(len(b) for b in before.values()) // 2
    with file_size_limit(limit):
        with pytest.raises(OSError, match="File too large"):
            MetricsLogger(tmp_path, 300, start_step=150, progress=False)  # keeps 150 lines: more than the limit
        with pytest.raises(OSError, match="File too large"):
            save_config(tmp_path, {**TrainConfig().to_dict(), "notes": "y" * limit})
        with pytest.raises(OSError, match="File too large"):
            write_json(results, [failed("grpo", "y" * limit)], {"presets": ["grpo"]})
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.json", "config.yaml", "metrics.jsonl"]  # no .tmp


def test_overwrite_replaces_only_a_run_and_never_through_a_symlink(tmp_path, capsys):
    """`--overwrite` used to empty any directory, even through a symlink, and the "not empty" error suggested it
    for a directory that holds no run."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work", encoding="utf-8")
    status, err = command("--output-dir", str(notes), *TINY_FLAGS, "--steps", "1", capsys=capsys)
    assert status == 2 and "is not empty" in err and "--overwrite" not in err
    status, err = command("--output-dir", str(notes), *TINY_FLAGS, "--steps", "1", "--overwrite", capsys=capsys)
    assert status == 2 and "holds no run (config.yaml and metrics.jsonl), so it is not cleared" in err
    run = tmp_path / "run"
    assert command("--output-dir", str(run), *TINY_FLAGS, "--steps", "1", capsys=capsys)[0] == 0
    link = tmp_path / "link"
    link.symlink_to(run)
    status, err = command("--output-dir", str(link), *TINY_FLAGS, "--steps", "1", "--overwrite", capsys=capsys)
    assert status == 2 and "is a symlink; --overwrite never clears what a link points to" in err
    assert (notes / "thesis.tex").is_file() and latest(run) == checkpoint_dir(run, 1)
    assert command("--output-dir", str(run), *TINY_FLAGS, "--steps", "2", "--overwrite", capsys=capsys)[0] == 0
    assert latest(run) == checkpoint_dir(run, 2)


@pytest.mark.parametrize("failure", ("enospc", "short"))
def test_a_full_disk_while_logging_leaves_whole_lines_and_names_the_file(tmp_path, monkeypatch, failure):
    """A full disk used to leave a cut last line in metrics.jsonl, and an error without the file's name."""
    logger = MetricsLogger(tmp_path, total_steps=3, progress=False)
    logger.log(1, {"reward": 0.5})
    path = tmp_path / "metrics.jsonl"
    real_write = os.write

    def full_disk(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") != str(path):
            return real_write(fd, data)
        if failure == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data[: len(data) // 2])  # what fitted

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match=rf"^no space left on device while writing {re.escape(str(path))} \(errno ENOSPC"):
        logger.log(2, {"reward": 0.25})
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == '{"step": 1, "reward": 0.5}\n'
    assert read_metrics(tmp_path) == [{"step": 1, "reward": 0.5}]

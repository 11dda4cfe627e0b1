"""`compare` owns its directory and its runs: a second compare (or --resume) there is refused naming its PID, its
run's process dies with it even after SIGKILL (stopping at a step boundary, with a checkpoint), `--resume` refuses
while a run of it is still in use, and a damaged `compare.json` row is one line naming the row."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.compare.__main__ import main as compare_main
from grpo_kernels.compare.report import summarize, write_json
from grpo_kernels.compare.runs import CompareConfig
from grpo_kernels.trainer.checkpoint import checkpoint_dir, latest
from grpo_kernels.trainer.logging import read_metrics
from tests.test_run_dir import run_main
from tests.test_run_writers import wait_for

LOCK_FILE = ".run.lock"  # what a run's process holds (trainer/run_lock.py)

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TINY_FLAGS = ["--prompts-per-step", "2", "--num-generations", "2", "--hidden-size", "16", "--num-layers", "1"]
TINY_FLAGS += ["--num-heads", "2"]


def compare(*args: str, capsys) -> tuple[int, str]:
    status, _, err = run_main(compare_main, args, capsys)
    return status, err


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def training_child(parent: int) -> int:
    """The PID of the run's process that compare `parent` spawned (not multiprocessing's resource tracker)."""
    children = " ".join(
        Path(f"/proc/{parent}/task/{t}/children").read_text() for t in os.listdir(f"/proc/{parent}/task")
    )
    spawned = [int(p) for p in children.split() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(spawned) == 1, children
    return spawned[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_compare_takes_its_run_with_it_and_resume_waits_for_a_run_in_use(tmp_path, capsys):
    """`kill -9` of compare used to leave its training child running; a `compare --resume` then trained in the
    same folder beside it (twice the metric lines)."""
    out = tmp_path / "cmp"
    command = [sys.executable, "-m", "grpo_kernels.compare", "--presets", "grpo", "--steps", "100000"]
    parent = subprocess.Popen([*command, "--output-dir", str(out), *TINY_FLAGS], env=ENV, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(read_metrics(out / "grpo")) >= 2 or parent.poll() is not None)
        assert parent.poll() is None
        status, err = compare("--resume", "--output-dir", str(out), capsys=capsys)
        assert status == 2 and f"is in use by process {parent.pid} " in err, err
        child = training_child(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not alive(child), 60)
    finally:
        parent.kill()
        parent.wait()
    steps = [m["step"] for m in read_metrics(out / "grpo")]
    assert steps == list(range(1, len(steps) + 1))
    assert latest(out / "grpo") == checkpoint_dir(out / "grpo", steps[-1])  # it stopped at a step boundary
    holds = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
    holds += "os.ftruncate(fd, 0); os.write(fd, str(os.getpid()).encode()); print(flush=True); sys.stdin.read()"
    leftover = subprocess.Popen(  # a process holding the run's lock (a run still going, as an older version left)
        [sys.executable, "-c", holds, str(out / "grpo" / LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        leftover.stdout.readline()
        status, err = compare("--resume", "--output-dir", str(out), capsys=capsys)
    finally:
        leftover.kill()
        leftover.wait()
    assert status == 2 and f"run '{out / 'grpo'}' is still in use by process {leftover.pid} " in err, err


def test_a_compare_json_row_without_its_curve_is_one_line(tmp_path, capsys):
    """A row without "curve" used to be a raw KeyError traceback."""
    out = tmp_path / "cmp"
    out.mkdir()
    config = CompareConfig(presets=("grpo",), steps=1, output_dir=str(out), train_args=tuple(TINY_FLAGS))
    write_json(
        out / "compare.json",
        [
            summarize(
                "grpo",
                [{"step": 1, "reward": 0.5, "step_time": 1.0}],
                [4],
                threshold=0.8,
                window=1,
                peak_memory_bytes=0,
                wall_seconds=1.0,
            )
        ],
        {**dataclasses.asdict(config)},
    )
    data = json.loads((out / "compare.json").read_text())
    del data["runs"][0]["curve"]
    (out / "compare.json").write_text(json.dumps(data))
    status, err = compare("--resume", "--output-dir", str(out), capsys=capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "compare.json: run row 0: missing fields ['curve']" in err

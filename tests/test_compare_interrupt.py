"""`python -m grpo_kernels.compare` interrupted and resumed: SIGTERM during the second run stops it and writes the
table, JSON and plot of the finished run with the stopped one marked, in one line on stderr and no traceback;
`--resume --output-dir DIR` keeps the finished run and runs the rest. Preset names compare case-insensitively."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kernels.compare import CompareConfig
from grpo_kernels.compare.runs import run_configs

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
COMPARE = [sys.executable, "-m", "grpo_kernels.compare"]
TINY = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--num-generations", "2"]
TINY += ["--prompts-per-step", "2", "--device", "cpu"]


def test_preset_names_compare_case_insensitively(tmp_path):
    with pytest.raises(ValueError, match="presets must differ"):
        run_configs(CompareConfig(presets=("grpo", "GRPO"), output_dir=str(tmp_path)))
    configs = run_configs(CompareConfig(presets=("GRPO", "Dapo"), output_dir=str(tmp_path)))
    assert {p: c.output_dir for p, c in configs.items()} == {
        "grpo": str(tmp_path / "grpo"),
        "dapo": str(tmp_path / "dapo"),
    }


def test_sigterm_keeps_the_finished_runs_and_resume_continues_the_rest(tmp_path):
    out = tmp_path / "cmp"
    args = ["--presets", "grpo,rloo", "--steps", "12", "--window", "1", "--output-dir", str(out), "--checkpoint-every"]
    process = subprocess.Popen(
        [*COMPARE, *args, "4", *TINY], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not (out / "rloo" / "checkpoints" / "step_000004").is_dir():  # grpo finished, rloo is under way
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the second run wrote no checkpoint within 300 s"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith("interrupted: 1 of 2 runs finished, rloo interrupted") and "--resume" in stderr
    runs = json.loads((out / "compare.json").read_text())["runs"]
    assert [(r["preset"], r["error"]) for r in runs] == [("grpo", None), ("rloo", "interrupted")]
    assert "| rloo | interrupted |" in (out / "compare.md").read_text() and (out / "compare.svg").is_file()
    assert "Traceback" not in (out / "rloo.log").read_text()

    resumed = subprocess.run(
        [*COMPARE, "--resume", "--output-dir", str(out)], cwd=tmp_path, env=ENV, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "[1/2] grpo: finished before, kept" in resumed.stdout
    assert "resuming from" in (out / "rloo.log").read_text()  # from its checkpoint, not from step 0
    rows = json.loads((out / "compare.json").read_text())["runs"]
    assert rows[0] == runs[0] and rows[1]["error"] is None and [s for s, _ in rows[1]["curve"]] == list(range(1, 13))
    refused = subprocess.run(
        [*COMPARE, "--resume", "--output-dir", str(out), "--steps", "5"], env=ENV, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "drop --steps" in refused.stderr

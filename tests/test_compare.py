"""`python -m grpo_kernels.compare`: a tiny comparison end to end (2 presets x 2 steps, each run in its own process as
compare starts it), its table from hand-made metrics, and its user errors (one line, exit status 2, before any run).

The command's `main(argv)` runs in this process (no interpreter start-up per test); one user error runs as a real
`python -m grpo_kernels.compare` subprocess, proving what needs a process: the line on stderr, the exit status 2."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from grpo_kernels.compare import CompareConfig, summarize
from grpo_kernels.compare.__main__ import main
from grpo_kernels.compare.report import failed, markdown_table
from grpo_kernels.compare.runs import prepare_output, run_configs

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
COMPARE = [sys.executable, "-m", "grpo_kernels.compare"]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(COMPARE + args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def test_two_presets_two_steps_write_table_json_plot_and_one_run_directory_each(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    monkeypatch.chdir(tmp_path)
    main(["--presets", "grpo,rloo", "--steps", "2", "--output-dir", str(out), "--window", "1"])
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in progress] == ["[1/2] grpo", "[2/2] rloo"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".run.lock", "compare.md", "compare.json", "compare.svg", "grpo", "grpo.log", "rloo", "rloo.log"]
    )
    for preset in ("grpo", "rloo"):  # the trainer's own run directory, its config naming the preset
        assert (out / preset / "metrics.jsonl").read_text().count("\n") == 2
        assert f"preset: {preset}" in (out / preset / "config.yaml").read_text()
    data = json.loads((out / "compare.json").read_text())
    assert [r["preset"] for r in data["runs"]] == ["grpo", "rloo"]
    assert data["setup"]["steps"] == 2 and data["setup"]["trainer"]["num_generations"] == 16
    for row in data["runs"]:
        assert row["error"] is None and row["steps"] == 2 and [s for s, _ in row["curve"]] == [1, 2]
        assert row["tokens_per_second"] > 0 and row["peak_memory_mib"] > 0
        assert 0.0 <= row["greedy_accuracy"] <= 1.0  # the last step evaluates
    table = (out / "compare.md").read_text()
    assert "| preset | final reward | steps to 0.8 | greedy accuracy |" in table
    assert table.count("\n| grpo |") == 1 and table.count("\n| rloo |") == 1
    svg = ElementTree.parse(out / "compare.svg").getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 2


BAD_FLAGS = [
    (["--stepz", "3"], "unrecognized arguments: --stepz 3"),
    (["--preset", "dapo"], "--preset: set by compare for each run"),
    (["--presets", "grpo,nope"], "unknown preset 'nope'"),
]


@pytest.mark.parametrize(("args", "message"), BAD_FLAGS)
def test_a_bad_flag_is_one_error_line_and_exit_status_2(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*args, "--output-dir", str(tmp_path / "cmp")])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "cmp").exists()  # refused before any run


def test_a_bad_flag_in_a_process_is_one_stderr_line_and_exit_status_2(tmp_path):
    """`python -m grpo_kernels.compare` itself (its entry point, the process's exit status), on the error raised
    inside the command."""
    args, message = BAD_FLAGS[2]
    result = run([*args, "--output-dir", str(tmp_path / "cmp")], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "cmp").exists()


def test_run_configs_share_seed_and_budget_and_refuse_compares_own_flags(tmp_path):
    config = CompareConfig(
        presets=("grpo", "dapo"), steps=7, seed=3, output_dir=str(tmp_path), train_args=("--num-generations", "4")
    )
    configs = run_configs(config)
    assert {p: (c.steps, c.seed, c.num_generations, c.output_dir) for p, c in configs.items()} == {
        "grpo": (7, 3, 4, str(tmp_path / "grpo")),
        "dapo": (7, 3, 4, str(tmp_path / "dapo")),
    }
    assert configs["dapo"].loss.loss_type == "dapo" and configs["grpo"].loss.loss_type == "grpo"
    for bad, message in [
        (dict(presets=()), "at least one preset"),
        (dict(presets=("grpo", "grpo")), "must differ"),
        (dict(presets=("../x",)), "preset names"),
        (dict(presets=("grpo",), train_args=("--seed", "1")), "--seed: set by compare"),
        (dict(presets=("grpo",), window=0), "window must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            run_configs(CompareConfig(**bad))


def test_a_non_empty_output_dir_is_refused_unless_overwrite(tmp_path):
    """--overwrite replaces a comparison (its compare.json), never another directory's contents."""
    (tmp_path / "other_run").mkdir()
    with pytest.raises(ValueError, match="is not empty .*; or choose another"):
        prepare_output(CompareConfig(presets=("grpo",), output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="holds no comparison .*so it is not cleared"):
        prepare_output(CompareConfig(presets=("grpo",), output_dir=str(tmp_path), overwrite=True))
    (tmp_path / "compare.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="is not empty .*--overwrite replaces its contents"):
        prepare_output(CompareConfig(presets=("grpo",), output_dir=str(tmp_path)))
    prepare_output(CompareConfig(presets=("grpo",), output_dir=str(tmp_path), overwrite=True))
    assert list(tmp_path.iterdir()) == []


def test_summary_from_hand_made_metrics():
    history = [  # the task's reward is rewards/task where the preset's reward differs from it
        {"step": 1, "reward": 0.125, "step_time": 1.0},
        {"step": 2, "reward": 0.875, "step_time": 1.0},
        {"step": 3, "reward": 0.5, "rewards/task": 0.75, "step_time": 2.0},
        {"step": 4, "reward": 0.875, "step_time": 9.0, "eval/answer": 0.75},  # an eval step: not in tokens/s
    ]
    row = summarize("x", history, [10, 20, 30, 99], threshold=0.8, window=2, peak_memory_bytes=2**21, wall_seconds=5)
    assert row.curve == [(1, 0.125), (2, 0.875), (3, 0.75), (4, 0.875)]
    assert row.final_reward == (0.75 + 0.875) / 2
    assert row.steps_to_threshold == 3  # 2-step means: 0.5, 0.8125 at step 3 (step 1 has no full window)
    assert row.greedy_accuracy == 0.75
    assert row.tokens_per_second == pytest.approx(60 / 4.0) and row.seconds_per_step == pytest.approx(4.0 / 3)
    assert row.peak_memory_mib == 2.0
    never = summarize("y", history[:2], [1, 1], threshold=0.95, window=1, peak_memory_bytes=0, wall_seconds=1)
    assert never.steps_to_threshold is None and never.greedy_accuracy is None
    table = markdown_table([row, never, failed("z", "preset 'z': refused")], threshold=0.8)
    lines = table.splitlines()
    assert lines[2] == "| x | 0.812 | 3 | 0.750 | 15 | 1.333 | 2 | 5 |"
    assert lines[3].startswith("| y | 0.875 | — | — |")
    assert lines[4] == "| z | failed: preset 'z': refused |" + " |" * 6
    assert all(line.count("|") == lines[0].count("|") for line in lines)

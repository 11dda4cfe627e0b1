"""Each example runs as a user runs it (`python examples/<name>.py`), shortened by GRPO_KERNELS_MAX_STEPS, and
prints what its docstring promises."""

import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, steps: int, monkeypatch, capsys) -> str:
    monkeypatch.setenv("GRPO_KERNELS_MAX_STEPS", str(steps))
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name)])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def test_own_loop_prints_the_reward_of_each_step(monkeypatch, capsys):
    out = run_example("own_loop.py", 3, monkeypatch, capsys)
    assert re.findall(r"^step +(\d+) +reward (\d\.\d+)", out, re.M)[-1][0] == "2"


def test_bandit_prints_the_best_arms_probability_and_why_the_reward_drifts(monkeypatch, capsys):
    out = run_example("bandit.py", 21, monkeypatch, capsys)
    assert "The mean reward drifts with all arms" in out
    assert len(re.findall(r"^round +\d+ +P\(best arm\) \d\.\d{3}", out, re.M)) == 2  # rounds 0 and 20
    assert out.rstrip().splitlines()[-1].startswith("final P(best arm) = ")


def test_trl_example_prints_stock_and_drop_in_side_by_side(monkeypatch, capsys):
    pytest.importorskip("trl")
    out = run_example("trl_grpo.py", 1, monkeypatch, capsys)
    (row,) = re.findall(r"^ +1 +([-\d.]+) / +([-\d.]+) +([-+\d.]+) / +([-+\d.]+) +([\d.]+) / +([\d.]+)$", out, re.M)
    assert row[0] == row[1] and row[2] == row[3]  # the same rewards and loss to the printed digits
    assert float(row[4]) == pytest.approx(float(row[5]), rel=1e-4)  # gradient norms
    assert "{'loss'" not in out  # no per-step dicts from the Trainer

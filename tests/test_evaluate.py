"""Greedy evaluation on held-out prompts, batched, and `python -m grpo_kernels.evaluate` comparing two tiny
checkpoints saved the way the trainer saves them (`<run>/checkpoints/step_N/` next to `<run>/config.yaml`)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo_kernels import evaluate as cli
from grpo_kernels.trainer.evaluate import evaluate
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.tasks import AdditionTask


def tiny_policy(seed: int):
    """A random tiny Llama on addition's alphabet; a large init gives varied greedy answers."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(AdditionTask().alphabet)
    model = build_tiny_llama(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_length=16, init_std=0.5)
    return model, tokenizer


def save_run(run: Path, settings: dict) -> list[Path]:
    """Two checkpoints of a fake run (different random weights) and its config.yaml."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "model": "tiny", **settings}), encoding="utf-8")
    paths = []
    for step in (0, 600):
        model, tokenizer = tiny_policy(seed=step)
        path = run / "checkpoints" / f"step_{step:06d}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths


def test_evaluate_is_the_same_in_any_batch_size():
    model, tokenizer = tiny_policy(seed=0)
    task = AdditionTask()
    whole = evaluate(model, tokenizer, task, max_completion_length=3)
    assert set(whole) == {"eval/reward", "eval/answer", "eval/closeness", "eval/format"}
    assert evaluate(model, tokenizer, task, max_completion_length=3, batch_size=8) == whole
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(model, tokenizer, task, max_completion_length=3, batch_size=0)


def test_cli_compares_two_checkpoints_with_the_runs_settings(tmp_path, capsys):
    first, last = save_run(tmp_path / "run", {"dataset": "addition", "max_sum": 6, "max_completion_length": 2})
    output = tmp_path / "results.json"
    results = cli.main(["--model", str(first), "--compare", str(last), "--eval-size", "9", "--output", str(output)])
    assert json.loads(output.read_text(encoding="utf-8")) == results
    settings = {"dataset": "addition", "max_sum": 6, "eval_size": 9, "max_completion_length": 2}
    assert results["settings"] == settings  # the run's config.yaml, then the flags
    assert results["num_prompts"] == 28  # every a+b= with a + b <= 6
    task = AdditionTask(max_sum=6)
    for role, path in (("model", first), ("compare", last)):
        model, tokenizer = cli.load_model(str(path), torch.device("cpu"))
        expected = evaluate(model, tokenizer, task, max_completion_length=2)
        assert results[role]["name"] == str(path)
        assert results[role]["metrics"] == {name.removeprefix("eval/"): value for name, value in expected.items()}
    b, a = results["compare"]["metrics"], results["model"]["metrics"]
    assert results["difference"] == pytest.approx({name: b[name] - a[name] for name in a})
    assert results["model"]["metrics"] != results["compare"]["metrics"]  # two different policies
    printed = capsys.readouterr().out
    assert "accuracy (answer)" in printed and "B − A" in printed and "step_000600" in printed


def test_cli_one_model_plain_table_and_bad_dataset(tmp_path, capsys, monkeypatch):
    (model_dir,) = save_run(tmp_path / "run", {"dataset": "addition"})[:1]
    monkeypatch.setitem(sys.modules, "rich.table", None)  # rich not installed: a plain-text table
    results = cli.main(["--model", str(model_dir), "--max-completion-length", "3"])
    assert "compare" not in results and results["settings"]["max_completion_length"] == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["metric", "A"] and lines[2].startswith("accuracy (answer)")
    assert lines[3].split() == ["reward", f"{results['model']['metrics']['reward']:.3f}"]
    with pytest.raises(ValueError, match="dataset must be one of"):  # before any model is loaded
        cli.main(["--model", str(tmp_path / "no_such_model"), "--dataset", "bogus"])
    with pytest.raises(ValueError, match="no_such_model': no such directory"):  # not a hub error
        cli.main(["--model", str(tmp_path / "no_such_model")])
    run_dir = cli.main(["--model", str(tmp_path / "run"), "--max-completion-length", "3"])  # its latest checkpoint
    assert run_dir["model"]["name"] == str(tmp_path / "run" / "checkpoints" / "step_000600")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="a run directory without a complete checkpoint"):
        cli.main(["--model", str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="not a model directory"):  # neither a run nor a model directory
        cli.main(["--model", str(tmp_path / "empty" / "checkpoints")])

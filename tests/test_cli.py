"""The two commands as a user meets them: a user error is one line, `error: ...`, with exit status 2 (`--debug`: the
traceback); `--help` gives every option a sentence and its choices without loading transformers; values out of range
are refused; a run without a terminal prints a start line and progress lines.

Each user error runs the command's `main(argv)` in this process (no interpreter start-up per case); one error per
command runs as a real `python -m` subprocess, proving what needs a process: the line on stderr, no traceback, the
process's exit status 2."""

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from grpo_kernels import evaluate, presets
from grpo_kernels.options import LOSS_TYPES, LossOptions
from grpo_kernels.trainer import TrainConfig, cli, parse_args
from grpo_kernels.trainer.__main__ import main as train_main
from grpo_kernels.trainer.config import NOT_CLI, PER_STEP_LOSS_OPTIONS, build_parser, check_config, field_docs
from grpo_kernels.trainer.parallel import PARALLEL_MODES
from grpo_kernels.trainer.tasks import DATASETS

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TRAIN = [sys.executable, "-m", "grpo_kernels.train"]
EVALUATE = [sys.executable, "-m", "grpo_kernels.evaluate"]
COMMANDS: dict[str, tuple[list[str], Callable[[Sequence[str]], None]]] = {  # name -> (process, in-process main)
    "train": (TRAIN, train_main),
    "evaluate": (EVALUATE, lambda argv: cli.run(evaluate.main, argv)),  # what `python -m grpo_kernels.evaluate` runs
}


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


USER_ERRORS = {  # name -> (command, its arguments, what its one line says)
    "unknown preset": ("train", ["--preset", "nope"], "unknown preset 'nope'"),
    "missing dataset": ("train", ["--dataset", "missing.jsonl"], "dataset file 'missing.jsonl' does not exist"),
    "unknown dataset": ("train", ["--dataset", "bogus"], "dataset must be one of"),
    "output dir is a file": ("train", ["--output-dir", "a_file"], "output_dir 'a_file' is a file"),
    "negative steps": ("train", ["--steps", "-5"], "steps must be >= 1, got -5"),
    "not a number": ("train", ["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    "budget 0": ("train", ["--max-completion-length", "0"], "max_completion_length must be >= 1"),
    "unknown option": ("train", ["--stepz", "3"], "unrecognized arguments: --stepz 3"),
    "unknown loss type": ("train", ["--loss-type", "ppo"], "loss_type must be one of"),
    "resume, no checkpoint": ("train", ["--resume", "--output-dir", "empty"], "no checkpoint in 'empty'"),
    "device cuda": ("train", ["--device", "cuda"], "CUDA is not available"),
    "evaluate missing model": (
        "evaluate",
        ["--model", "runs/none/checkpoints/step_000600"],
        "model 'runs/none/checkpoints/step_000600': no such directory",
    ),
    "evaluate eval size 0": ("evaluate", ["--model", "x", "--eval-size", "0"], "must be >= 1, got 0"),
    "evaluate device cuda": ("evaluate", ["--model", "x", "--device", "cuda"], "CUDA is not available"),
}
IN_A_PROCESS = ("unknown preset", "evaluate missing model")  # one per command, raised inside `cli.run`


def _skip_cuda_errors_on_a_cuda_machine(case: str) -> None:
    if "cuda" in case and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")


@pytest.mark.parametrize("case", USER_ERRORS)
def test_a_user_error_is_one_line_and_exit_status_2(case, tmp_path, monkeypatch, capsys):
    """The command's `main(argv)`: exit status 2, nothing on stdout, one `error:` line on stderr."""
    command, args, message = USER_ERRORS[case]
    _skip_cuda_errors_on_a_cuda_machine(case)
    (tmp_path / "a_file").write_text("", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        COMMANDS[command][1](args)
    out, err = capsys.readouterr()
    assert stop.value.code == 2, err
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and message in err


@pytest.mark.parametrize("case", IN_A_PROCESS)
def test_a_user_error_in_a_process_is_one_stderr_line_without_traceback_and_exit_status_2(case, tmp_path):
    """`python -m grpo_kernels.<command>` itself: the process exits with 2 and writes one `error:` line, no traceback
    (what the in-process test above cannot see: the module's entry point and the interpreter's handling)."""
    command, args, message = USER_ERRORS[case]
    result = run(COMMANDS[command][0] + args, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    """`--debug`: the error is raised, not turned into a line (uncaught, the interpreter prints its traceback)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        train_main(["--preset", "nope", "--debug"])


def test_help_names_every_option_with_a_sentence_and_its_choices():
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    docs = {**field_docs(LossOptions), **field_docs(TrainConfig)}
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in NOT_CLI]  # loss, sources: no flag
    names += [f.name for f in dataclasses.fields(LossOptions) if f.name not in PER_STEP_LOSS_OPTIONS]
    for name in names:
        assert len(docs[name].split()) >= 3, f"option {name} has no sentence: {docs[name]!r}"
        assert re.search(f"--{name.replace('_', '-')}[ ,]", text), name
    assert "TrainConfig.steps" not in text  # the field's name is no help
    for choice in [*presets.available(), *LOSS_TYPES, *DATASETS, *PARALLEL_MODES, "cuda:N", "tensorboard", "vllm"]:
        assert choice in text, choice


HEAVY = ("transformers", "grpo_kernels.trainer.train", "grpo_kernels.trainer.tasks", "torch._dynamo")


@pytest.mark.parametrize(
    "module, heavy", [("grpo_kernels.train", (*HEAVY, "safetensors")), ("grpo_kernels.evaluate", HEAVY)]
)
def test_help_imports_nothing_heavy(module, heavy):
    """`python -m <command> --help` loads grpo_kernels (hence torch) and none of the trainer's heavy dependencies,
    which made it slow (4.3 s where the import alone takes 1.3 s on the 2-core CI machine; evaluate reads
    checkpoints, so it may load safetensors). Checked by what is loaded, not by the clock (timings belong to the
    benchmarks): the command runs as `python -m` runs it."""
    probe = (
        f"import runpy, sys\nsys.argv = [{module!r}, '--help']\ntry:\n"
        f"    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], env=ENV, capture_output=True, text=True, check=True)
    assert "usage:" in loaded.stdout
    assert loaded.stdout.splitlines()[-1] == "[]", loaded.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(steps=-5), "steps must be >= 1"),
        (dict(checkpoint_every=-1), "checkpoint_every must be >= 0"),
        (dict(eval_size=0), "eval_size must be >= 1"),
        (dict(num_generations=1), "num_generations must be >= 2"),
        (dict(learning_rate=0.0), "learning_rate must be > 0"),
        (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization must be <= 1.0"),
        (dict(torch_threads=0), "torch_threads must be >= 1"),
        (dict(num_heads=3), r"num_heads \(3\) must divide hidden_size \(64\)"),
        (dict(report_to="mlflow"), "report_to must be one of"),
        (dict(resume=True, overwrite=True), "resume and overwrite contradict"),
    ],
)
def test_values_out_of_range_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(dataclasses.replace(TrainConfig(), **overrides))


def test_wrong_types_from_a_yaml_file_are_refused(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("steps: ten\n", encoding="utf-8")
    with pytest.raises(TypeError, match="steps must be an int, got 'ten'"):
        parse_args(["--config", str(config_file)])
    assert parse_args(["--torch-threads", "none"]).torch_threads is None


def test_a_run_without_a_terminal_prints_a_start_line_and_progress_lines(tmp_path):
    flags = ["--steps", "3", "--prompts-per-step", "4", "--num-generations", "4", "--eval-every", "0"]
    result = run(TRAIN + ["--output-dir", "runs/tiny", *flags, "--progress-every", "2", "--no-plot"], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("GRPO run 'tiny', from step 0 to step 3: preset grpo (loss_type grpo, beta 0.04)")
    assert lines[0].endswith("config runs/tiny/config.yaml, output runs/tiny")
    progress = [line.split()[1] for line in lines if line.startswith("step ")]
    assert progress == ["2/3", "3/3"] and "reward=" in lines[1]

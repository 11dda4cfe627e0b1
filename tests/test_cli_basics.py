"""The commands' basics: `--version`, `python -m grpo_kernels`, a new run directory per run, `--resume` naming the
latest run, `--paper-settings`, the sampler round limit's flag and the step cap of quick checks."""

import dataclasses
import os
import runpy
import sys
from pathlib import Path

import pytest

import grpo_kernels
from grpo_kernels.trainer import parse_args, run_names
from grpo_kernels.trainer.components import SAMPLERS
from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.samplers import GPG_MAX_ROUNDS, MAX_NUM_GEN_BATCHES
from tests.test_trainer_presets import FakeSource


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
def test_version_on_every_command_and_the_package_lists_its_commands(capsys, monkeypatch):
    for module in ("grpo_kernels.train", "grpo_kernels.compare", "grpo_kernels.evaluate"):
        monkeypatch.setattr(sys, "argv", [module, "--version"])
        with pytest.raises(SystemExit) as stop:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        assert (stop.value.code, capsys.readouterr().out) == (0, f"grpo-kernels {grpo_kernels.__version__}\n")
    monkeypatch.setattr(sys, "argv", ["grpo_kernels"])
    runpy.run_module("grpo_kernels", run_name="__main__")
    out = capsys.readouterr().out
    for command in ("train", "compare", "evaluate"):
        assert sum(f"python -m grpo_kernels.{command} " in line for line in out.splitlines()) == 1
    monkeypatch.setattr(sys, "argv", ["grpo_kernels", "--version"])
    runpy.run_module("grpo_kernels", run_name="__main__")
    assert capsys.readouterr().out == f"grpo-kernels {grpo_kernels.__version__}\n"
    monkeypatch.setattr(sys, "argv", ["grpo_kernels", "--verison"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("grpo_kernels", run_name="__main__")
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("error: python -m grpo_kernels takes --version")


def test_runs_without_output_dir_get_new_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = parse_args([])
    assert first.output_dir.startswith("runs/demo-")
    assert Path(first.output_dir).is_dir()  # claimed by creating it: the next name differs, also within a second
    second = parse_args([])
    assert second.output_dir != first.output_dir and second.output_dir.startswith("runs/demo-")
    assert parse_args(["--preset", "dapo"]).output_dir.startswith("runs/dapo-")
    assert parse_args(["--dataset", "countdown"]).output_dir.startswith("runs/countdown-")
    assert parse_args(["--output-dir", "mine"]).output_dir == "mine"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="under torchrun give --output-dir"):
        parse_args([])


def test_resume_needs_output_dir_and_names_the_latest_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"--resume needs --output-dir.*no run under runs/ yet"):
        parse_args(["--resume"])
    for name in ("demo-1", "dapo-2"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text("steps: 1\n", encoding="utf-8")
    os.utime(tmp_path / "runs" / "demo-1" / "config.yaml", (1, 1))  # the older one
    with pytest.raises(ValueError, match=r"the latest run here: --output-dir runs/dapo-2\)"):
        parse_args(["--resume"])


def test_a_preset_keeps_the_trainers_settings_unless_paper_settings():
    defaults, dapo = TrainConfig(), parse_args(["--preset", "dapo", "--output-dir", "x"])
    kept = ("learning_rate", "num_generations", "num_iterations", "max_completion_length")
    assert [getattr(dapo, n) for n in kept] == [getattr(defaults, n) for n in kept]
    assert dapo.loss.loss_type == "dapo" and dapo.loss.temperature == defaults.loss.temperature
    paper = parse_args(["--preset", "dapo", "--paper-settings", "--output-dir", "x"])
    assert paper.learning_rate == 1e-6 and paper.paper_settings
    grpo = parse_args(["--paper-settings", "--output-dir", "x"])  # the default preset, with its paper's settings
    assert (grpo.preset, grpo.learning_rate, grpo.num_generations) == ("grpo", 1e-6, 64)


def test_max_num_gen_batches_sets_the_samplers_limit_and_their_errors_name_it():
    config = TrainConfig(prompts_per_step=2)
    assert SAMPLERS["dapo_dynamic"](config).filler.max_num_gen_batches == MAX_NUM_GEN_BATCHES
    assert SAMPLERS["gpg_valid"](config).max_rounds == GPG_MAX_ROUNDS
    unlimited = dataclasses.replace(config, max_num_gen_batches=0)
    assert SAMPLERS["dapo_dynamic"](unlimited).filler.max_num_gen_batches == 0
    assert SAMPLERS["gpg_valid"](unlimited).max_rounds == 0
    assert parse_args(["--max-num-gen-batches", "50", "--output-dir", "x"]).max_num_gen_batches == 50
    two = dataclasses.replace(config, max_num_gen_batches=2)
    with pytest.raises(ValueError, match=r"gpg_valid: 2 rounds .*--max-num-gen-batches N raises the limit \(0: none"):
        SAMPLERS["gpg_valid"](two)(FakeSource([[1.0] * 4] * 2))
    source = FakeSource([[1.0] * 4] * 25 + [[0.0, 1.0, 0.0, 1.0]])  # past GPG's own 20 rounds, then valid groups
    assert SAMPLERS["gpg_valid"](unlimited)(source).metrics["sampling/rounds"] == 26


def test_the_step_cap_of_quick_checks(monkeypatch, capsys):
    monkeypatch.setenv(run_names.MAX_STEPS_VARIABLE, "3")
    assert parse_args(["--steps", "300", "--output-dir", "x"]).steps == 3
    assert "GRPO_KERNELS_MAX_STEPS=3: steps 300 capped at 3" in capsys.readouterr().out
    assert parse_args(["--steps", "2", "--output-dir", "x"]).steps == 2


def test_dynamic_sampling_that_runs_out_of_rounds_trains_on_what_it_kept(capsys):
    """A solved task (every group all right) does not stop the run: after max_num_gen_batches rounds the step trains
    on the groups it kept, or on the last round whole (zero advantages), says so once and logs it every step."""
    sampler = SAMPLERS["dapo_dynamic"](TrainConfig(prompts_per_step=2, max_num_gen_batches=2))
    kept_one = sampler(FakeSource([[1.0] * 4, [0.0, 1.0, 1.0, 1.0]]))  # round 2 keeps its first group only
    assert kept_one.round.scores.rewards.tolist() == [0.0, 1.0]
    assert kept_one.metrics["sampling/short_batch"] == 1.0 and kept_one.metrics["sampling/groups_kept"] == 1
    line = capsys.readouterr().out
    assert "2 generation rounds kept 1 of 2 prompts" in line and "train on the 1 it kept" in line
    assert "--max-num-gen-batches N sets the limit (0: none; it may change on --resume)" in line
    kept_none = sampler(FakeSource([[1.0] * 4, [0.0] * 4]))  # nothing kept: the last round, all wrong
    assert kept_none.round.scores.verdict.tolist() == [False] * 4 and kept_none.metrics["sampling/short_batch"] == 1
    assert capsys.readouterr().out == ""  # said once
    full = sampler(FakeSource([[0.0, 1.0, 1.0, 0.0]]))
    assert full.metrics["sampling/short_batch"] == 0.0 and full.metrics["sampling/rounds"] == 1


def test_the_round_limit_may_change_on_resume():
    from grpo_kernels.trainer.run_dir import config_differences

    saved = parse_args(["--preset", "dapo", "--output-dir", "x"])
    assert config_differences(saved, dataclasses.replace(saved, max_num_gen_batches=0)) == []
    assert config_differences(saved, dataclasses.replace(saved, learning_rate=1.0)) != []  # the check still works


def test_mistyped_options_and_presets_and_a_missing_run_directory_say_what_was_meant(tmp_path, monkeypatch, capsys):
    from grpo_kernels.evaluate import main as evaluate_main
    from grpo_kernels.trainer.cli import run

    with pytest.raises(SystemExit) as stop:
        parse_args(["--stpes", "3"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --stpes 3; did you mean --steps?" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown preset 'dapoo' \(did you mean 'dapo'\?\)"):
        parse_args(["--preset", "dapoo", "--output-dir", "x"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    with pytest.raises(SystemExit):
        run(evaluate_main, ["--model", "runs/nope"])
    assert capsys.readouterr().err == (
        "error: model 'runs/nope': no such directory (in 'runs': demo); give a run directory or one of its "
        "checkpoints/step_NNNNNN\n"
    )

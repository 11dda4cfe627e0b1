"""Run directories and checkpoints (trainer/run_dir.py, trainer/checkpoint.py), on tiny runs of the demo policy: a
run never mixes with another run's files, `--resume` continues with the run's own config.yaml, loading a checkpoint
never runs code, an unreadable latest checkpoint falls back to the previous one, and a failed checkpoint write
(disk full) removes its `.tmp/` folder and says so."""

import dataclasses
import errno
import os
from pathlib import Path

import pytest
import torch
import yaml

from grpo_kernels.trainer import TrainConfig, atomic_write, train
from grpo_kernels.trainer import checkpoint as checkpoint_module
from grpo_kernels.trainer.__main__ import main
from grpo_kernels.trainer.checkpoint import checkpoint_dir, latest
from grpo_kernels.trainer.config import apply_preset
from grpo_kernels.trainer.logging import TIMES, read_metrics
from grpo_kernels.trainer.train import GRPOTrainer

TINY = dict(prompts_per_step=4, num_generations=4, eval_every=0, checkpoint_every=1, progress=False, plot=False)
TINY_FLAGS = ["--prompts-per-step", "4", "--num-generations", "4", "--eval-every", "0", "--checkpoint-every", "1"]
TIMING = TIMES


def tiny(output_dir: Path, **overrides) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), output_dir=str(output_dir), **{**TINY, **overrides})


def without_timing(history: list[dict], evaluation: bool = True) -> list[dict]:
    """The records without their timings (and without the evaluations, which a run's last step always makes)."""
    keep = lambda k: k not in TIMING and (evaluation or not k.startswith("eval/"))  # noqa: E731
    return [{k: v for k, v in m.items() if keep(k)} for m in history]


def saved_seeds(output_dir: Path) -> set[int]:
    """The seed in every checkpoint's trainer state."""
    states = [torch.load(p / "trainer_state.pt", weights_only=True) for p in checkpoint_module.complete(output_dir)]
    return {state["config"]["seed"] for state in states}


def run_main(command_main, args, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command's `main(args)` run in this process."""
    capsys.readouterr()
    try:
        command_main(list(args))
        status = 0
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err


def command(*args: str, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m grpo_kernels.train ARGS`, run as its `main` in this process (the
    command as a process: tests/test_cli.py)."""
    return run_main(main, args, capsys)


def test_a_new_run_refuses_a_non_empty_output_dir_unless_overwrite(tmp_path):
    """The mix-up of the issue: a second run into the same directory used to leave the first run's checkpoints
    there (a later --resume then picked the other run's highest step)."""
    out = tmp_path / "run"
    train(tiny(out, steps=2, seed=0))
    with pytest.raises(ValueError, match="is not empty .*--resume continues the run there, --overwrite replaces it"):
        train(tiny(out, steps=1, seed=1))
    assert saved_seeds(out) == {0} and latest(out) == checkpoint_dir(out, 2)  # untouched
    history = train(tiny(out, steps=1, seed=1, overwrite=True))
    assert saved_seeds(out) == {1} and latest(out) == checkpoint_dir(out, 1)  # step_000002 of seed 0 is gone
    assert read_metrics(out) == history and [m["step"] for m in history] == [1]
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="'.*file' is a file"):
        GRPOTrainer(tiny(tmp_path / "file", steps=1))


def test_resume_continues_with_the_runs_own_config_end_to_end(tmp_path, monkeypatch, capsys):
    """The README's `--preset dapo --steps 2`, then `--resume --steps 3` without the preset: the run goes on as
    dapo (β = 0, no reference model) and makes the same steps as one uninterrupted 3-step dapo run; any option
    outside the resumable ones that differs is a one-line error naming it."""
    budget = ["--max-completion-length", "1"]  # a lone digit: right 1 time in 16, so DAPO's filter keeps groups
    monkeypatch.chdir(tmp_path)
    status, _, err = command(
        "--preset",
        "dapo",
        "--paper-settings",
        "--steps",
        "2",
        "--output-dir",
        "d",
        *TINY_FLAGS,
        *budget,
        "--no-plot",
        capsys=capsys,
    )
    assert status == 0, err
    status, out, err = command("--resume", "--steps", "3", "--output-dir", "d", "--no-plot", capsys=capsys)
    assert status == 0, err
    assert out.startswith("GRPO run 'd', resuming from d/checkpoints/step_000002 (step 2) to step 3")
    saved = yaml.safe_load((tmp_path / "d" / "config.yaml").read_text(encoding="utf-8"))
    assert (saved["preset"], saved["loss"]["loss_type"], saved["loss"]["beta"], saved["steps"]) == (
        "dapo",
        "dapo",
        0.0,
        3,
    )
    assert not (checkpoint_dir(tmp_path / "d", 3) / "ref_model.safetensors").exists()
    flags = dict(num_generations=4, max_completion_length=1)  # the flags, which win over the preset's settings
    straight = train(dataclasses.replace(apply_preset(tiny(tmp_path / "straight", steps=3), "dapo"), **flags))
    assert without_timing(read_metrics(tmp_path / "d"), False) == without_timing(straight, False)

    status, out, err = command(
        "--resume", "--steps", "4", "--output-dir", "d", "--seed", "1", "--beta", "0.1", capsys=capsys
    )
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("error: --resume: the run in 'd' (config.yaml) was made with other options: ")
    assert "seed: 0 -> 1" in line and "beta: 0.0 -> 0.1" in line


def test_resume_without_a_checkpoint_stops_or_starts_as_the_flag_says(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint in .* --start-if-no-checkpoint"):
        GRPOTrainer(tiny(tmp_path / "empty", steps=1, resume=True))
    history = train(tiny(tmp_path / "empty", steps=1, resume=True, start_if_no_checkpoint=True))
    assert [m["step"] for m in history] == [1]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no config.yaml"):
        GRPOTrainer(tiny(tmp_path / "foreign", steps=1, resume=True, start_if_no_checkpoint=True))


class _Payload:
    """Unpickling this runs `code` (what a planted rng_rank0.pt could do)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def test_a_planted_pickle_payload_does_not_run_on_resume(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "payload_ran"
    train(tiny(out, steps=1))
    planted = checkpoint_dir(out, 1) / "rng_rank0.pt"
    torch.save({"torch": _Payload(f"open({str(marker)!r}, 'w').close()")}, planted)
    torch.load(planted, weights_only=False)  # the payload is real: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    refusal = "step_000001/rng_rank0.pt: holds a reference to exec, not only tensors.*previous good checkpoint .*step_0"
    with pytest.raises(ValueError, match=refusal):
        train(tiny(out, steps=2, resume=True))
    assert not marker.exists()


@pytest.mark.parametrize("broken", ["model.safetensors", "trainer_state.pt", "ref_model.safetensors"])
def test_an_unreadable_latest_checkpoint_is_refused_offering_the_previous_one(tmp_path, broken):
    """Never a silent fallback: the refusal names the file and the previous good checkpoint; moving the bad one
    aside resumes from that one, exactly."""
    out = tmp_path / "run"
    train(tiny(out, steps=2))
    bad = checkpoint_dir(out, 2)
    file = bad / broken
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # truncated, as by a full disk without fsync
    offer = f"step_000002/{broken}: .*the previous good checkpoint is .*step_000001 \\(step 1\\)"
    with pytest.raises(ValueError, match=f"checkpoint .*step_000002 is refused: .*{offer}"):
        GRPOTrainer(tiny(out, steps=3, resume=True))
    bad.rename(bad.with_name(bad.name + ".corrupt"))
    resumed = train(tiny(out, steps=3, resume=True))
    straight = train(tiny(tmp_path / "straight", steps=3))
    assert without_timing(resumed) == without_timing(straight)  # exactly as if resumed from step 1
    for step in (0, 1):
        (checkpoint_dir(out, step) / "trainer_state.pt").write_bytes(b"garbage")
    for step in (2, 3):  # written again by the resumed run
        (checkpoint_dir(out, step) / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no earlier checkpoint reads back whole; --overwrite starts"):
        GRPOTrainer(tiny(out, steps=4, resume=True))


class _FullDisk:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, path, mode, room: int = 100) -> None:
        self.file, self.room = open(path, mode), room  # noqa: SIM115

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_a_failed_checkpoint_write_removes_its_tmp_folder_and_says_no_space_left(tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = GRPOTrainer(tiny(out, steps=1))
    trainer.train()
    monkeypatch.setattr(checkpoint_module, "open", _FullDisk, raising=False)  # torch.save's writes in checkpoint.py
    trainer.step = 2
    with pytest.raises(OSError, match=r"^no space left on the device while writing checkpoint .*step_000002") as info:
        trainer.save_checkpoint()
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000", "step_000001"]  # no .tmp
    assert latest(out) == checkpoint_dir(out, 1)


def test_checkpoint_files_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(atomic_write, "fsync", lambda path: events.append(("fsync", Path(path).name)))
    rename = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", Path(b).name)), rename(a, b)))
    train(tiny(tmp_path / "run", steps=1, checkpoint_every=0))  # one checkpoint: step 1
    synced = {name for kind, name in events[: events.index(("rename", "step_000001"))] if kind == "fsync"}
    files = {p.name for p in checkpoint_dir(tmp_path / "run", 1).iterdir()}
    assert files <= synced and "trainer_state.pt" in files and "model.safetensors" in files

"""Checkpoints that are what was written, and a run that always leaves one.

- Every checkpoint lists the SHA-256 of each of its files (`checksums.json`); `--resume` verifies them and refuses
  a changed file in one line naming it and the previous good checkpoint, never falling back silently.
- The last step always leaves a checkpoint, also when its update was skipped as non-finite, and says which step.
- A file-system write error other than a full disk (a file-size limit: EFBIG) is one `error:` line too."""

import dataclasses
import importlib
import json
import math
import resource
import signal
import struct

import pytest
import torch

from grpo_kernels.evaluate import main as evaluate_main
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.__main__ import main as train_main
from grpo_kernels.trainer.checkpoint import checkpoint_dir, latest
from grpo_kernels.trainer.cli import run as run_command
from grpo_kernels.trainer.logging import TIMES
from grpo_kernels.trainer.train import GRPOTrainer
from tests.test_run_dir import run_main

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, prompts_per_step=2, num_generations=2, eval_every=0)
TINY.update(progress=False, plot=False)
TINY_FLAGS = ["--prompts-per-step", "2", "--num-generations", "2", "--eval-every", "0", "--no-plot"]
TINY_FLAGS += ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--no-progress"]


def tiny(output_dir, **overrides) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), output_dir=str(output_dir), **TINY, **overrides)


def flip_a_bit_in_a_tensor(file) -> None:
    """Flip one bit inside the first tensor's data of a safetensors file (its header stays valid)."""
    data = bytearray(file.read_bytes())
    header_size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_size])
    start = min(t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    data[8 + header_size + start + 2] ^= 0x10
    file.write_bytes(bytes(data))


def test_a_bit_flip_in_a_tensor_is_refused_naming_the_file_and_the_previous_checkpoint(tmp_path):
    """A flipped bit in a tensor used to load silently, and the resumed run's numbers differed."""
    out = tmp_path / "run"
    GRPOTrainer(tiny(out, steps=2, checkpoint_every=1)).train()
    flip_a_bit_in_a_tensor(checkpoint_dir(out, 2) / "model.safetensors")
    expected = (
        r"checkpoint .*step_000002 is refused: .*step_000002/model.safetensors: checksum mismatch.*; the previous "
        r"good checkpoint is .*step_000001 \(step 1\)"
    )
    with pytest.raises(ValueError, match=expected):
        GRPOTrainer(tiny(out, steps=3, checkpoint_every=1, resume=True))
    assert latest(out) == checkpoint_dir(out, 2)  # nothing moved, nothing resumed


def poison_gradients_from(trainer: GRPOTrainer, step: int) -> None:
    weight = next(p for p in trainer.model.parameters() if p.requires_grad)
    weight.register_hook(lambda grad: grad * math.nan if trainer.step >= step else grad)


def test_a_skipped_last_step_still_leaves_a_final_checkpoint_and_says_so(tmp_path, capsys):
    """With --checkpoint-every 0 (every compare run) and the last step skipped as non-finite, no model was saved."""
    out = tmp_path / "run"
    trainer = GRPOTrainer(tiny(out, steps=2, checkpoint_every=0, skip_nonfinite_steps=1))
    poison_gradients_from(trainer, 2)
    trainer.train()
    said = capsys.readouterr().out
    assert latest(out) == checkpoint_dir(out, 2)
    assert f"final checkpoint {checkpoint_dir(out, 2)}: step 2 (step 2's update was skipped as non-finite)" in said
    resumed = GRPOTrainer(tiny(out, steps=3, checkpoint_every=0, resume=True))
    assert resumed.resumed_from == checkpoint_dir(out, 2)
    assert not (tmp_path / "none").exists()
    GRPOTrainer(tiny(tmp_path / "none", steps=1, checkpoint_every=0, final_checkpoint=False)).train()
    assert latest(tmp_path / "none") is None  # the user said otherwise


def test_a_file_too_large_while_writing_a_checkpoint_is_one_line(tmp_path, capsys):
    """EFBIG used to be a raw SafetensorError traceback (a full disk was already one line)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_960, hard))  # the demo model's weights take more
    flags = ["--prompts-per-step", "2", "--num-generations", "2", "--no-plot", "--no-progress", "--steps", "1"]
    try:
        with pytest.raises(SystemExit) as stop:
            train_main(["--output-dir", str(tmp_path / "run"), *flags])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: file too large while writing checkpoint ") and "errno EFBIG" in err, err
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))


class _FailingAt(GRPOTrainer):
    """Raises a RuntimeError in step `at`: before its updates ("advantages"), between them and the step's end
    ("sync": the sampler's weight push), or after its training ("evaluate", the last step's evaluation; with
    `nan_weight` after writing a non-finite weight)."""

    def __init__(self, config, at: int, where: str, monkeypatch, nan_weight: bool = False):
        super().__init__(config)
        self.at, self.where, self.nan_weight = at, where, nan_weight
        sync = self.rollout.sync_weights
        self.rollout.sync_weights = lambda: self._fail("sync") or sync()
        train_module = importlib.import_module("grpo_kernels.trainer.train")  # the package's `train` is a function
        evaluate = train_module.evaluate
        monkeypatch.setattr(train_module, "evaluate", lambda *args: self._fail("evaluate") or evaluate(*args))

    def _fail(self, where: str) -> None:
        if self.step == self.at and where == self.where:
            if self.nan_weight:
                with torch.no_grad():
                    next(self.model.parameters()).view(-1)[0] = math.nan
            raise RuntimeError(f"failed in {where}")

    def advantages(self, step, old_logp, entropy):
        self._fail("advantages")
        return super().advantages(step, old_logp, entropy)


def test_an_exception_in_the_last_step_leaves_the_last_whole_step_and_resumes_to_the_same_numbers(
    tmp_path, capsys, monkeypatch
):
    """With --checkpoint-every 0 (every compare run) an exception used to leave no checkpoint: every step lost."""
    straight = GRPOTrainer(tiny(tmp_path / "straight", steps=3, checkpoint_every=0)).train()
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="failed in advantages"):
        _FailingAt(tiny(out, steps=3, checkpoint_every=0), 3, "advantages", monkeypatch).train()
    said = capsys.readouterr().out
    assert latest(out) == checkpoint_dir(out, 2)  # the state before step 3: its prompts and RNG too
    assert f"RuntimeError in step 3: checkpoint {checkpoint_dir(out, 2)} holds step 2 of 3; continue:" in said
    history = GRPOTrainer(tiny(out, steps=3, checkpoint_every=0, resume=True)).train()
    timeless = lambda h: [{k: v for k, v in m.items() if k not in TIMES} for m in h]  # noqa: E731
    assert timeless(history) == timeless(straight)

    after = tmp_path / "after"  # the step's training returned: that step is whole
    with pytest.raises(RuntimeError, match="failed in evaluate"):
        _FailingAt(tiny(after, steps=2, checkpoint_every=0), 2, "evaluate", monkeypatch).train()
    assert latest(after) == checkpoint_dir(after, 2)


@pytest.mark.parametrize(
    ("where", "nan_weight", "reason"),
    [("sync", False, "after some of that step's updates"), ("evaluate", True, "is not finite")],
)
def test_no_checkpoint_of_a_half_done_step_or_of_non_finite_weights(
    tmp_path, capsys, monkeypatch, where, nan_weight, reason
):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=f"failed in {where}"):
        _FailingAt(tiny(out, steps=2, checkpoint_every=0), 2, where, monkeypatch, nan_weight=nan_weight).train()
    assert latest(out) is None
    assert reason in capsys.readouterr().out


def test_a_checkpoint_of_this_format_needs_a_whole_checksums_file_of_relative_names(tmp_path, capsys):
    """A missing, emptied or partial checksums.json was trusted, an absolute name read outside the checkpoint, and
    `evaluate` checked nothing."""
    out = tmp_path / "run"
    GRPOTrainer(tiny(out, steps=1, checkpoint_every=1)).train()
    saved = checkpoint_dir(out, 1)
    listing = saved / "checksums.json"
    whole = listing.read_text(encoding="utf-8")
    outside = tmp_path / "outside"
    outside.write_text("x", encoding="utf-8")
    cases = {
        "missing": None,
        "partial: it does not list": "{}",
        "refused: it names .*outside', outside the checkpoint": json.dumps({**json.loads(whole), str(outside): "0"}),
    }
    for reason, text in cases.items():
        listing.unlink(missing_ok=True)
        if text is not None:
            listing.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=rf"checksums.json: {reason}"):
            GRPOTrainer(tiny(out, steps=2, checkpoint_every=1, resume=True))
    listing.write_text(whole, encoding="utf-8")
    flip_a_bit_in_a_tensor(saved / "model.safetensors")
    status, _, err = run_main(lambda argv: run_command(evaluate_main, argv), ["--model", str(saved)], capsys)
    assert status == 2 and err.startswith("error: ") and "model.safetensors: checksum mismatch" in err, err


def test_a_checkpoint_written_before_checksums_is_taken_as_it_is(tmp_path):
    out = tmp_path / "run"
    GRPOTrainer(tiny(out, steps=1, checkpoint_every=1)).train()
    saved = checkpoint_dir(out, 1)
    state = torch.load(saved / "trainer_state.pt", weights_only=True)
    del state["format"]  # as this trainer wrote it before checksums.json
    torch.save(state, saved / "trainer_state.pt")
    (saved / "checksums.json").unlink()
    assert GRPOTrainer(tiny(out, steps=2, checkpoint_every=1, resume=True)).resumed_from == saved


def test_the_guards_latest_gaps_are_kept_across_resume(tmp_path):
    """The sampler-sync guard's mean gaps of the latest steps go into the checkpoint and a resumed run's trend rule
    reads them (a gap rising across the resume stops it as it would the run without one); a checkpoint whose gaps
    are not finite numbers >= 0 is refused in one line naming its trainer state."""
    from grpo_kernels.trainer.checkpoint import TRAINER_STATE_FILE, write_checksums

    out = tmp_path / "run"
    first = GRPOTrainer(tiny(out, steps=2, checkpoint_every=1))
    first.train()
    resumed = GRPOTrainer(tiny(out, steps=3, checkpoint_every=1, resume=True))
    assert len(first.sync_gaps) == 2 and resumed.sync_gaps == first.sync_gaps
    state_file = checkpoint_dir(out, 2) / TRAINER_STATE_FILE
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "sync_gaps": [0.1, math.nan]}, state_file)
    write_checksums(checkpoint_dir(out, 2))
    with pytest.raises(ValueError, match=rf"{TRAINER_STATE_FILE}: sync_gaps must be gaps >= 0, got \[0.1, nan\]"):
        GRPOTrainer(tiny(out, steps=3, checkpoint_every=1, resume=True))

"""The trainer with a teacher (`--teacher`, `--teacher-kl-coef`, `teacher_divergence`): a few steps of the demo with
a tiny teacher built from a config and saved as a model directory; its flags and YAML keys; its refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest

from grpo_kernels.trainer import TrainConfig, parse_args, train
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.tasks import build_task

QUIET = dict(progress=False, plot=False, checkpoint_every=0, eval_every=0, final_checkpoint=False)
SMALL = dict(steps=2, prompts_per_step=2, num_generations=4)


def save_teacher(path, alphabet: str) -> str:
    """A tiny Llama (another width and depth than the policy's) over `alphabet`'s tokenizer, saved to `path`."""
    tokenizer = build_tokenizer(alphabet)
    build_tiny_llama(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_length=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_teacher_term_trains_end_to_end(tmp_path):
    teacher = save_teacher(tmp_path / "teacher", build_task(TrainConfig()).alphabet)
    config = parse_args(["--output-dir", str(tmp_path / "run"), "--teacher", teacher, "--teacher-kl-coef", "0.5",
                         "--teacher-divergence", "{beta: 0.5, temperature: 0.9}"])  # fmt: skip
    assert config.loss.teacher_divergence.beta == 0.5 and config.loss.teacher_kl_coef == 0.5
    history = train(dataclasses.replace(config, **QUIET, **SMALL))
    assert len(history) == 2
    for record in history:
        assert math.isfinite(record["teacher/divergence"]) and record["teacher/divergence"] > 0
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "teacher_divergence:" in saved and "teacher_kl_coef: 0.5" in saved  # YAML keys under loss:


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="teacher and teacher_kl_coef go together"):
        parse_args(["--teacher-kl-coef", "0.1"])
    other = save_teacher(tmp_path / "other", "abcdef")
    config = parse_args(["--output-dir", str(tmp_path / "run"), "--teacher", other, "--teacher-kl-coef", "0.1"])
    with pytest.raises(ValueError, match="its tokenizer is not the policy's"):
        train(dataclasses.replace(config, **QUIET, **SMALL))

"""The trainer under non-finite updates and unbounded lengths: an optimizer step whose grad_norm is not finite is
refused (the run stops naming the step and the metric, keeping its last good checkpoint, or skips up to
`skip_nonfinite_steps` such steps); prompt + generation budget is checked against the model's context at start
(train and evaluate), against the demo model's cap, and per prompt, naming the file and line."""

import dataclasses
import json
import math

import pytest
import torch

from grpo_kernels.evaluate import main as evaluate_main
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.checkpoint import checkpoint_dir, latest
from grpo_kernels.trainer.config import DEMO_MAX_LENGTH, check_config, parse_args
from grpo_kernels.trainer.train import GRPOTrainer

TINY = dict(
    hidden_size=16, num_layers=1, num_heads=2, prompts_per_step=2, num_generations=2, eval_every=0, device="cpu"
)


def tiny(tmp_path, **overrides) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), output_dir=str(tmp_path), progress=False, plot=False, **TINY, **overrides)


def poison_gradients_from(trainer: GRPOTrainer, step: int) -> None:
    """NaN gradients (as a diverged loss gives) at every step from `step` on."""
    weight = next(p for p in trainer.model.parameters() if p.requires_grad)
    weight.register_hook(lambda grad: grad * math.nan if trainer.step >= step else grad)


def test_a_non_finite_grad_norm_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = GRPOTrainer(tiny(tmp_path, steps=3, checkpoint_every=1))
    poison_gradients_from(trainer, 2)
    with pytest.raises(ValueError, match=r"step 2: grad_norm is nan, so the optimizer step is refused"):
        trainer.train()
    assert latest(tmp_path) == checkpoint_dir(tmp_path, 1)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_skip_nonfinite_steps_skips_and_logs_each(tmp_path, capsys):
    trainer = GRPOTrainer(tiny(tmp_path, steps=3, checkpoint_every=0, skip_nonfinite_steps=2))
    poison_gradients_from(trainer, 2)
    history = trainer.train()
    out = capsys.readouterr().out
    assert "step 2: grad_norm is nan: optimizer step skipped (1 of at most 2)" in out
    assert "step 3: grad_norm is nan: optimizer step skipped (2 of at most 2)" in out
    assert [m["step"] for m in history] == [1]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    with pytest.raises(ValueError, match="skip_nonfinite_steps must be >= 0"):
        check_config(tiny(tmp_path, skip_nonfinite_steps=-1))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--entropy-coef", "nan"], "entropy_coef must be finite"),
        (["--learning-rate", "inf"], "learning_rate must be finite"),
        (["--temperature", "inf"], "temperature must be > 0 and finite"),
        (["--max-completion-length", "1000000000000"], f"max_completion_length must be <= {DEMO_MAX_LENGTH}"),
        (["--seed", str(2**70)], "seed must be <="),
    ],
)
def test_a_non_finite_or_unbounded_flag_is_refused_at_parse(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args(flags)


def test_a_jsonl_prompt_over_the_demo_cap_is_refused_naming_its_line(tmp_path):
    data = tmp_path / "data.jsonl"
    lines = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "split": "test"}]
    lines.append({"prompt": "1" * DEMO_MAX_LENGTH, "answer": "1"})
    data.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    with pytest.raises(
        ValueError, match=rf"data\.jsonl, line 3: prompt \+ generation budget = {DEMO_MAX_LENGTH + 1} \+ 64"
    ):
        GRPOTrainer(tiny(tmp_path / "run", dataset=str(data)))


def test_a_loaded_models_context_bounds_the_budget_in_train_and_evaluate(tmp_path, capsys):
    GRPOTrainer(tiny(tmp_path / "run", steps=1, checkpoint_every=1)).train()
    model = str(checkpoint_dir(tmp_path / "run", 0))  # a Hugging Face directory, context = 4 + 3 tokens
    with pytest.raises(ValueError, match=r"prompt \+ generation budget = 5 \+ 5 tokens, over the model's context \(8"):
        GRPOTrainer(tiny(tmp_path / "loaded", model=model, max_completion_length=5))
    with pytest.raises(ValueError, match=r"max_completion_length \(1000000000000\) leaves no room for a prompt"):
        evaluate_main(["--model", model, "--max-completion-length", str(10**12)])

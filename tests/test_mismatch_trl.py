"""The TRL drop-in's `rollout_correction` extension: TRL's own `vllm_importance_sampling` mode as a point of the
record gives stock TRL's loss and gradients, and a verl preset trains through the drop-in with its metrics logged."""

import math

import pytest
import torch

trl = pytest.importorskip("trl")

from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.rollout_correction import RolloutCorrection  # noqa: E402
from tests.conftest import assert_close  # noqa: E402
from tests.test_trl import LENGTHS, T, build, make_inputs, model_path, step, tokenizer  # noqa: E402, F401


def with_correction(trainer, correction):
    """The trainer with `GRPOConfig.rollout_correction` (the drop-in's field) set."""
    trainer.args.rollout_correction = correction
    return trainer


def sampler_inputs(trainer, seed: int) -> dict:
    inputs = make_inputs(trainer, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    noise = 0.3 * torch.randn(len(LENGTHS), T, generator=g) * inputs["completion_mask"]
    inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + noise
    return inputs


def test_trl_mode_as_a_point_equals_stock_trl(model_path, tokenizer):  # noqa: F811
    """token_truncate at 1.2: stock TRL with its importance_sampling_ratio against the drop-in forming it."""
    stock = build(trl.GRPOTrainer, model_path(), tokenizer, loss_type="dapo")
    ours = with_correction(build(drop_in.GRPOTrainer, model_path(), tokenizer, loss_type="dapo"),
                           RolloutCorrection.from_trl("token_truncate", None, 1.2))  # fmt: skip
    inputs = sampler_inputs(stock, 2)
    mask = inputs["completion_mask"].bool()
    ratio = torch.exp(inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).clamp(max=1.2)
    stock.use_vllm = stock.vllm_importance_sampling_correction = True
    loss_a, grads_a, _ = step(stock, {**inputs, "importance_sampling_ratio": torch.where(mask, ratio, 1.0)})
    loss_b, grads_b, metrics = step(ours, inputs)
    assert_close(loss_b, loss_a, torch.float32, "loss")
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], torch.float32, name)
    assert "rollout_corr/kl" in metrics and "rollout_corr/rollout_is_mean" in metrics


def test_verl_preset_through_the_drop_in(model_path, tokenizer):  # noqa: F811
    ours = with_correction(build(drop_in.GRPOTrainer, model_path(), tokenizer, loss_type="grpo"),
                           "decoupled_k3_rs_token_tis")  # fmt: skip
    loss, grads, metrics = step(ours, sampler_inputs(ours, 3))
    assert math.isfinite(loss.item()) and grads
    assert 0.0 <= metrics["rollout_corr/rollout_rs_masked_fraction"] <= 1.0
    with pytest.raises(ValueError, match="REINFORCE presets"):
        drop_in.check_supported(with_correction(ours, "bypass_pg_is"))

"""The sampler-sync guard and the rollout correction read one computation: the gap (`sampler_gap`, TRL's
`sampling_logp_difference`) is among the correction's `rollout_corr/` metrics, and where the correction is on the guard
reads it from the update's loss (no second computation), logs it under TRL's names and still stops a sabotaged push
at step 1 before the optimizer step (the stand-in vLLM, `tests/fake_vllm.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_kernels.losses.mismatch import rollout_correction
from grpo_kernels.losses.mismatch_metrics import sampler_gap
from grpo_kernels.rollout_correction import preset
from grpo_kernels.trainer import vllm_rollout
from grpo_kernels.trainer.sampler_sync import StaleSampler, correction_gap
from grpo_kernels.trainer.train import GRPOTrainer
from tests.vllm_engine_cases import install_stand_in_cpu_build, vllm_demo

DIFF = "sampling/sampling_logp_difference"
CORRECTED = "rollout_corr/sampling_logp_difference"


def test_the_gap_is_the_mean_and_max_over_kept_scored_tokens():
    torch.manual_seed(0)
    train, sampling = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.3
    sampling[0, 0], mask[0, 0] = float("nan"), True  # a token the sampler could not score: left out
    sampling[1, 1], mask[1, 1] = 50.0, False  # padding: left out
    kept = mask & ~torch.isnan(sampling)
    expected = (train - sampling).abs()[kept]
    mean, largest = sampler_gap(train, sampling, mask)
    torch.testing.assert_close(mean, expected.mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(largest, expected.max(), rtol=0, atol=0)
    nothing = sampler_gap(train, sampling, torch.zeros_like(mask))
    assert [float(x) for x in nothing] == [0.0, 0.0]
    metrics = rollout_correction(train, sampling, mask, preset("decoupled_token_is")[0]).metrics
    assert metrics[f"{CORRECTED}_mean"] == mean and metrics[f"{CORRECTED}_max"] == largest


def test_the_guard_reads_the_token_weighted_mean_and_the_largest_max_of_the_micro_batches():
    micro = [
        ({f"{CORRECTED}_mean": 0.002, f"{CORRECTED}_max": 0.01}, 0.25),
        ({f"{CORRECTED}_mean": 0.001, f"{CORRECTED}_max": 0.03}, 0.75),
    ]
    gap = correction_gap(micro)
    assert gap == {f"{DIFF}/mean": pytest.approx(0.00125, rel=1e-12), f"{DIFF}/max": 0.03}


def corrected_demo(tmp_path, **overrides):
    config = vllm_demo(tmp_path, **overrides)
    correction, _ = preset("decoupled_token_is")
    return dataclasses.replace(config, loss=dataclasses.replace(config.loss, rollout_correction=correction))


def test_with_the_correction_the_guard_logs_the_corrections_gap(monkeypatch, tmp_path):
    install_stand_in_cpu_build(monkeypatch)
    history = GRPOTrainer(corrected_demo(tmp_path, gradient_accumulation_steps=2)).train()
    for record in history:
        assert record[f"{DIFF}/mean"] == pytest.approx(record[f"{CORRECTED}_mean"], rel=1e-12, abs=0)
        assert 0.0 <= record[f"{DIFF}/mean"] <= record[f"{DIFF}/max"] <= 1e-5  # fp32 noise: the push reached it


@pytest.mark.parametrize("old_logprobs", ["pass", "auto"])
def test_with_the_correction_a_push_that_does_nothing_stops_at_step_1_before_its_optimizer_step(
    monkeypatch, tmp_path, old_logprobs
):
    install_stand_in_cpu_build(monkeypatch)
    monkeypatch.setattr(vllm_rollout, "push_weights", lambda llm, weights, official: None)  # sabotaged
    trainer = GRPOTrainer(corrected_demo(tmp_path, old_logprobs=old_logprobs))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(StaleSampler, match=r"^step 1: the sampler's log-probs .* a weight push did not reach it$"):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))

"""The sampler-sync guard: TRL's `sampling/...` metrics from π_old and the sampler's log-probs, reduced over ranks, and
the stop when a sampler does not have the policy's weights. On the stand-in `vllm` (`tests/fake_vllm.py`, its CPU
build, sampling from the pushed weights): a push that does nothing stops the run at step 1, and a working one keeps
the gap at fp32 noise. The same against the real engine: `tests/test_vllm_cpu_train.py`."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_kernels.trainer import vllm_rollout
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.sampler_sync import (
    StaleSampler,
    check_sampler_sync,
    logp_tolerance,
    over_ranks,
    rising_gap,
    sampling_metrics,
)
from grpo_kernels.trainer.train import GRPOTrainer
from tests.vllm_engine_cases import install_stand_in_cpu_build, vllm_demo

DIFF, RATIO = "sampling/sampling_logp_difference", "sampling/importance_sampling_ratio"


def test_metrics_are_trls_over_the_kept_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    sampled = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, float("nan"), 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    token_ratio = torch.exp(old - sampled)  # [B, T]: NaN at the token the sampler could not score
    metrics = sampling_metrics(old, sampled, mask, token_ratio.nan_to_num(1.0))
    kept = torch.tensor([0.5, 0.0, 0.25])  # |Δ| at the kept tokens; the NaN one left out, as TRL does
    assert metrics[f"{DIFF}/mean"] == pytest.approx(kept.mean().item())
    assert metrics[f"{DIFF}/max"] == pytest.approx(0.5)
    ratios = [math.exp(0.5), 1.0, math.exp(-0.25), 1.0]  # at the kept tokens (the NaN one's ratio set to 1)
    assert metrics[f"{RATIO}/min"] == pytest.approx(min(ratios)) and metrics[f"{RATIO}/max"] == pytest.approx(
        max(ratios)
    )
    assert metrics[f"{RATIO}/mean"] == pytest.approx(sum(ratios) / 4)
    sequence = sampling_metrics(old, sampled, mask, torch.tensor([0.5, 2.0]))  # a sequence mode's [B] ratio
    assert (sequence[f"{RATIO}/min"], sequence[f"{RATIO}/mean"], sequence[f"{RATIO}/max"]) == (0.5, 1.25, 2.0)
    off = sampling_metrics(old, sampled, mask, None)  # the correction off: only the gap
    assert set(off) == {f"{DIFF}/mean", f"{DIFF}/max"}
    empty = sampling_metrics(old, sampled, torch.zeros_like(mask), None)
    assert empty == {f"{DIFF}/mean": 0.0, f"{DIFF}/max": 0.0}


def test_one_process_keeps_the_metrics_and_the_limit_follows_the_precision():
    metrics = {f"{DIFF}/mean": 0.25, f"{DIFF}/max": 2.0, f"{RATIO}/min": 0.5}
    assert over_ranks(metrics, ParallelState(0, 1, torch.device("cpu"), "none")) == metrics
    assert logp_tolerance(torch.float32, torch.float32) == 1e-3
    assert logp_tolerance(torch.float32, torch.bfloat16) == logp_tolerance(torch.bfloat16, torch.bfloat16) == 3e-2
    check_sampler_sync({f"{DIFF}/mean": 1e-3, f"{DIFF}/max": 0.5}, 1e-3, step=4)  # at the limit: on
    with pytest.raises(StaleSampler, match=r"^step 4: .* by 0\.002 nats per token on average \(max 0\.5; the limit"):
        check_sampler_sync({f"{DIFF}/mean": 2e-3, f"{DIFF}/max": 0.5}, 1e-3, step=4)


def test_the_trend_rule_stops_a_gap_rising_at_two_steps_in_a_row_above_its_floor():
    limit = 3e-2  # floor: 1e-2
    assert rising_gap([5.9e-3, 1.6e-2, 2.6e-2], limit)  # a push that skips one layer (bf16, docs/trainer.md)
    assert not rising_gap([5.9e-3, 1.8e-3, 4.4e-3, 3.1e-3], limit)  # the same model's bf16 noise
    assert not rising_gap([1e-3, 2e-3, 4e-3], limit)  # rising, but under the floor
    assert not rising_gap([1.2e-2, 1.5e-2, 2.2e-2], limit)  # over the floor, but under 2× over the two steps
    assert not rising_gap([5.9e-3, 2.6e-2, 1.6e-2], limit)  # over the floor and 2×, but not rising at each step
    assert not rising_gap([1.6e-2, 2.6e-2], limit)  # too few steps
    assert not rising_gap([0.0, 0.0, 2e-2], limit)  # no rise from 0 to 0
    gap = {f"{DIFF}/mean": 2.6e-2, f"{DIFF}/max": 0.3}
    check_sampler_sync(gap, limit, step=3, earlier=[1.6e-2, 1.7e-2])  # under the limit, rising under 2×
    with pytest.raises(StaleSampler, match=r"^step 3: .* rising at each of the last 2 steps: 0.0059 → 0.016 → 0.026"):
        check_sampler_sync(gap, limit, step=3, earlier=[0.1, 5.9e-3, 1.6e-2])


# ------------------------------------------------------------------- the trainer on the stand-in's CPU build
@pytest.fixture
def cpu_vllm(monkeypatch):
    """The stand-in's CPU build, sampling from the demo's architecture with the pushed weights."""
    install_stand_in_cpu_build(monkeypatch)
    return monkeypatch


def test_a_push_that_does_nothing_stops_the_run_at_step_1(cpu_vllm, tmp_path):
    cpu_vllm.setattr(vllm_rollout, "push_weights", lambda llm, weights, official: None)  # sabotaged
    trainer = GRPOTrainer(vllm_demo(tmp_path))
    with pytest.raises(StaleSampler, match=r"^step 1: the sampler's log-probs .* a weight push did not reach it"):
        trainer.train()
    assert trainer.step == 1


def test_a_working_push_keeps_the_gap_at_fp32_noise(cpu_vllm, tmp_path):
    history = GRPOTrainer(vllm_demo(tmp_path)).train()
    assert [r["step"] for r in history] == [1, 2]
    for record in history:
        assert record[f"{DIFF}/max"] <= 1e-5 and abs(record[f"{RATIO}/mean"] - 1) <= 1e-5
        assert record[f"{RATIO}/min"] <= record[f"{RATIO}/mean"] <= record[f"{RATIO}/max"]


def test_hf_rollouts_log_the_same_metrics_at_fp32_noise(tmp_path):
    history = GRPOTrainer(vllm_demo(tmp_path, rollout="hf", device="auto")).train()
    assert all(r[f"{DIFF}/max"] <= 1e-5 and r[f"{DIFF}/mean"] <= 1e-6 for r in history)

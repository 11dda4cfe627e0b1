"""`python -m grpo_kernels.train --rollout vllm --device cpu` on the demo task with vLLM's real CPU engine: the reward
rises, `--resume` in the middle continues the run, the sampler-sync guard reads fp32 noise at every step, also with
truncated sampling (π_old replayed over the sampler's support); and a push that does nothing stops the run at
step 1."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.trainer import vllm_rollout
from grpo_kernels.trainer.sampler_sync import KEPT_MASS, StaleSampler
from grpo_kernels.trainer.train import GRPOTrainer
from tests.vllm_engine_cases import import_cpu_vllm, memory_share, vllm_demo

pytestmark = pytest.mark.vllm
import_cpu_vllm()

REPO = Path(__file__).resolve().parents[1]
DIFF = "sampling/sampling_logp_difference"


def train(output_dir: Path, steps: int, *extra: str) -> list[dict]:
    command = [
        *(sys.executable, "-m", "grpo_kernels.train", "--rollout", "vllm", "--device", "cpu", "--num-heads", "2"),
        *("--no-vllm-enable-sleep-mode", "--vllm-gpu-memory-utilization", str(memory_share())),
        *("--steps", str(steps), "--output-dir", str(output_dir), "--no-progress", "--no-plot", *extra),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM rollout, rank 0: cpu (vLLM's CPU engine)" in done.stdout
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_cpu_vllm_demo_learns_and_resumes(tmp_path):
    run = tmp_path / "run"
    first = train(run, 20)
    assert [r["step"] for r in first] == list(range(1, 21))
    records = train(run, 40, "--resume")  # a new engine, pushed the checkpoint's weights
    assert [r["step"] for r in records] == list(range(1, 41)) and records[:20] == first
    assert all(r[f"{DIFF}/max"] <= 1e-5 for r in records), max(r[f"{DIFF}/max"] for r in records)
    early, late = (sum(r["reward"] for r in part) / 10 for part in (records[:10], records[-10:]))
    assert late > early + 0.05, (early, late)


def test_a_push_that_does_nothing_stops_the_run_at_step_1(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_rollout, "push_weights", lambda llm, weights, official: None)
    config = vllm_demo(tmp_path, vllm_gpu_memory_utilization=memory_share())
    with pytest.raises(StaleSampler, match=r"^step 1: .* by \S+ nats per token on average"):
        GRPOTrainer(config).train()


def test_a_truncated_training_run_on_the_engine_passes_the_guard(tmp_path):
    """Two steps of the demo with vLLM's CPU engine sampling top-k 8, top-p 0.9, min-p 0.05: the guard's gap stays
    at fp32 noise and the correction's ratio at 1 (π_old replayed), while the mass π_old keeps is below 1."""
    config = vllm_demo(tmp_path, vllm_gpu_memory_utilization=memory_share())
    config = dataclasses.replace(config, loss=dataclasses.replace(config.loss, top_k=8, top_p=0.9, min_p=0.05))
    history = GRPOTrainer(config).train()
    assert [r["step"] for r in history] == [1, 2]
    for record in history:
        assert record["sampling/sampling_logp_difference/max"] <= 1e-5
        assert abs(record["sampling/importance_sampling_ratio/mean"] - 1) <= 1e-5
        assert 0.0 < record[KEPT_MASS] < 0.999 and record["sampling/outside_support"] == 0.0

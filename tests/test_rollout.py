"""Rollout engines: HFRollout's sampling log-probs equal a teacher-forced pass through the fused lm_head; VLLMRollout
without vLLM is a clear ImportError, its pure helpers are unit-tested, and on a stand-in `vllm` module it keeps the
sleep / wake / weight-push order that does not lose the pushed weights."""

import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from grpo_kernels.integrations.hf import policy_logprobs
from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.rollout import HFRollout, completion_mask
from grpo_kernels.trainer.train import build_rollout
from grpo_kernels.trainer.vllm_rollout import (
    VLLMRollout,
    llm_kwargs,
    pad_left,
    pad_right,
    sampled_tokens,
    sampling_params_kwargs,
    vllm_weight_name,
)
from tests.conftest import assert_close

ALPHABET = "0123456789+="


def tiny_policy(seed: int = 0):
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(ALPHABET)
    return build_tiny_llama(tokenizer, hidden_size=32, num_layers=2, num_heads=4, max_length=16).eval(), tokenizer


def test_completion_mask_covers_up_to_the_first_eos():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 5, 2, 0]])
    expected = [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert completion_mask(ids, eos_token_id=2).tolist() == expected


def test_hf_rollout_logprobs_match_a_teacher_forced_pass():
    model, tokenizer = tiny_policy()
    rollout = HFRollout(model, tokenizer, max_completion_length=5, temperature=0.7)
    torch.manual_seed(1)
    prompts, G = ["3+4=", "12+7=", "5="], 8  # different lengths: left padding
    batch = rollout.generate(prompts, G)

    B, T = len(prompts) * G, batch.completion_ids.shape[1]
    assert batch.prompt_ids.shape[0] == B and batch.completion_mask.shape == (B, T) and T <= 5
    assert batch.group_ids.tolist() == [i for i in range(len(prompts)) for _ in range(G)]
    assert batch.truncated.any() and not batch.truncated.all()  # some rows stopped at <eos>, some ran out
    after_eos = ~batch.completion_mask
    assert (batch.completion_ids[after_eos] == tokenizer.pad_token_id).all()
    assert (batch.sampling_logp[after_eos] == 0).all()
    assert not batch.prompt_mask[:G, 0].any() and batch.prompt_mask[G : 2 * G].all()  # "3+4=" is left-padded

    with torch.no_grad():
        teacher_forced = policy_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.completion_mask, temperature=0.7
        )
    assert_close(batch.sampling_logp, teacher_forced, torch.float32, "sampling logp")
    rows = zip(batch.completions, batch.completion_ids, batch.completion_mask, batch.truncated, strict=True)
    for text, ids, keep, cut in rows:
        tokens = ids[keep].tolist()
        assert text == tokenizer.decode(tokens if cut else tokens[:-1], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------------------- vLLM
def test_vllm_rollout_without_vllm_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    model, tokenizer = tiny_policy()
    with pytest.raises(ImportError, match=r"pip install 'grpo-kernels\[vllm\]'"):
        VLLMRollout(model, tokenizer, "some/model", max_completion_length=3)
    with pytest.raises(ImportError, match="--rollout hf"):
        build_rollout(TrainConfig(rollout="vllm", model="org/model"), model, tokenizer)
    with pytest.raises(ValueError, match="--rollout vllm needs --model"):
        build_rollout(TrainConfig(rollout="vllm"), model, tokenizer)


def test_vllm_pure_helpers():
    kwargs = llm_kwargs("m", gpu_memory_utilization=0.3, enable_sleep_mode=True, seed=3, max_model_len=64)
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["enable_sleep_mode"] is True
    assert (kwargs["model"], kwargs["gpu_memory_utilization"], kwargs["seed"]) == ("m", 0.3, 3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        llm_kwargs("m", gpu_memory_utilization=1.5, enable_sleep_mode=True, seed=0, max_model_len=64)
    params = sampling_params_kwargs(num_generations=8, temperature=0.7, max_tokens=16)
    assert params == dict(n=8, temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, max_tokens=16, logprobs=0)
    with pytest.raises(ValueError, match="temperature"):
        sampling_params_kwargs(8, 0.0, 16)
    assert vllm_weight_name("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    ids, mask = pad_left([[1, 5], [1, 5, 6, 7]], pad_id=0)
    assert ids.tolist() == [[0, 0, 1, 5], [1, 5, 6, 7]] and mask.tolist() == [[False, False, True, True], [True] * 4]
    assert pad_right([[1.5], [2.0, 3.0]], 0.0, torch.float32).tolist() == [[1.5, 0.0], [2.0, 3.0]]
    outputs = [fake_request([[5, 2], [6, 7, 8]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]])]
    assert sampled_tokens(outputs) == ([[5, 2], [6, 7, 8]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]])
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_tokens([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=None)])])


def fake_request(token_rows, logp_rows):
    """A `RequestOutput` as `LLM.generate` returns it with `logprobs=0`: the sampled token's Logprob per step."""
    samples = [
        SimpleNamespace(
            token_ids=tuple(ids),
            logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(ids, lps, strict=True)],
        )
        for ids, lps in zip(token_rows, logp_rows, strict=True)
    ]
    return SimpleNamespace(outputs=samples)


class FakeLLM:
    """Records what VLLMRollout asks of `vllm.LLM`; `generate` returns fixed completions (one ends with <eos>)."""

    calls: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.pushed = kwargs, []
        FakeLLM.calls = [("LLM", kwargs["enable_sleep_mode"])]
        model = SimpleNamespace(load_weights=lambda weights: self._load(weights))
        runner = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=runner))

    def _load(self, weights):
        self.pushed.append({name: tensor.clone() for name, tensor in weights})
        FakeLLM.calls.append(("load_weights",))

    def sleep(self, level=1):
        FakeLLM.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        FakeLLM.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        FakeLLM.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, *args, **kwargs):
        FakeLLM.calls.append(("collective_rpc", method))

    def generate(self, prompts, sampling_params, use_tqdm=True):
        FakeLLM.calls.append(("generate", len(prompts), sampling_params.kwargs["n"]))
        rows = [[5, 2], [6, 7, 8]]  # "3" then <eos>; "45" and "6" without one (max_tokens = 3)
        return [fake_request(rows, [[-0.5, -0.25], [-1.0, -2.0, -3.0]]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return module


def test_vllm_rollout_sleep_wake_and_weight_push_order(fake_vllm):
    model, tokenizer = tiny_policy()
    rollout = VLLMRollout(model, tokenizer, "tiny", max_completion_length=3, temperature=0.7, enable_sleep_mode=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the in-process engine core
    assert rollout.llm.kwargs["logprobs_mode"] == "processed_logprobs"

    batch = rollout.generate(["3+4=", "1+1="], 2)  # step 1
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # an optimizer step
    rollout.sync_weights()
    rollout.generate(["2+2="], 2)  # step 2
    assert FakeLLM.calls == [
        ("LLM", True),
        ("sleep", 2),  # free the GPU until the first generate
        ("wake_up", ("weights",)),  # weights mapped before they are written
        ("load_weights",),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("generate", 2, 2),
        ("sleep", 2),  # free the GPU for the update
        ("wake_up", ("weights",)),  # sync_weights after the optimizer step
        ("load_weights",),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),  # no second push, and never collective_rpc("reload_weights")
        ("generate", 1, 2),
        ("sleep", 2),
    ]
    first, second = rollout.llm.pushed
    assert set(first) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(second[name], param.detach())
    name = next(n for n, _ in model.named_parameters())
    torch.testing.assert_close(second[name], first[name] + 1.0)

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert batch.completion_ids.tolist() == [[5, eos, pad], [6, 7, 8]] * 2
    assert batch.completion_mask.tolist() == [[True, True, False], [True, True, True]] * 2
    assert batch.sampling_logp.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]] * 2
    assert batch.completions == ["1", "234"] * 2 and batch.truncated.tolist() == [False, True] * 2
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.prompt_ids.tolist()[0] == tokenizer("3+4=")["input_ids"]

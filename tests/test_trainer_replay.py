"""Truncated sampling in the trainer (`--top-k`, `--top-p`, `--min-p`): both rollouts sample in vLLM's order, the
policy's old and current log-probs are replayed over the sampler's support (so the sampler-sync guard and the
importance ratio compare like with like), the reference stays full-vocabulary unless `--replay-reference`, and each
step logs the kept mass. On the tiny demo policy (CPU), with Hugging Face rollouts and the stand-in vLLM
(`tests/fake_vllm.py`, its CPU build sampling from the pushed weights); the real engine's kept sets and order are
`tests/test_vllm_cpu_replay.py`'s."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpo_kernels import reference
from grpo_kernels.trainer import sampling_replay
from grpo_kernels.trainer.__main__ import main as train_main
from grpo_kernels.trainer.config import TrainConfig, check_config
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.rollout import HFRollout
from grpo_kernels.trainer.sampler_sync import KEPT_MASS, StaleSampler
from grpo_kernels.trainer.train import GRPOTrainer
from tests import fake_vllm
from tests.vllm_engine_cases import install_stand_in_cpu_build, vllm_demo

DIFF, RATIO = "sampling/sampling_logp_difference", "sampling/importance_sampling_ratio"
LOSS_REPLAY = ("sampling/log_kept_mass", "sampling/outside_support")  # the loss's own replay metrics
RULE = dict(top_k=8, top_p=0.9, min_p=0.05)


def peaked_policy(seed: int = 0, peak: float = 2.5):
    """The tiny Llama (hidden 64, 2 heads) with its final norm scaled by `peak`: logits peaked enough that min-p cuts
    tokens and top-p keeps several."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer("0123456789+=")
    model = build_tiny_llama(tokenizer, hidden_size=64, num_layers=2, num_heads=2, max_length=16).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(peak)
    return model, tokenizer


def in_order(z: torch.Tensor, rules: list[dict]) -> torch.Tensor:
    """The kept set [..., V] of the rules applied one after another, each on what the ones before it left."""
    keep = torch.ones_like(z, dtype=torch.bool)
    for rule in rules:
        keep &= reference.sampler_support(z.masked_fill(~keep, -math.inf), **rule)
    return keep


def test_hf_rollouts_sample_in_vllms_order():
    """The sampling log-probs are the oracle's replay in vLLM's order (min-p, top-k, top-p) at every token;
    `generate`'s own order (min-p last) would keep other tokens at some of them, so it would not match."""
    model, tokenizer = peaked_policy()
    temperature, rule = 0.8, dict(top_p=0.8, min_p=0.1)
    rollout = HFRollout(model, tokenizer, max_completion_length=5, temperature=temperature, **rule)
    torch.manual_seed(2)
    batch = rollout.generate(["3+4=", "1+1=", "2+5=", "9+0="], 8)
    logits, targets, sampled = [], [], []
    for i in range(len(batch.completions)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
        completion = batch.completion_ids[i][batch.completion_mask[i]]
        with torch.no_grad():
            logits.append(model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1])  # [n, V]
        targets.append(completion)
        sampled.append(batch.sampling_logp[i][batch.completion_mask[i]])
    logits, targets, sampled = torch.cat(logits), torch.cat(targets), torch.cat(sampled).double()  # [N, V], [N]
    z = logits.double() / temperature  # [N, V]
    vllm_order = reference.sampler_support(z, **rule)  # [N, V]
    logp, _ = reference.token_logprobs(logits, targets, temperature=temperature, support=vllm_order)  # [N]
    assert (logp - sampled).abs().max().item() <= 1e-5
    hf_order = in_order(z, [dict(top_p=rule["top_p"]), dict(min_p=rule["min_p"])])  # [N, V]
    differ = (hf_order != vllm_order).any(1)  # [N]
    assert differ.any(), "the two orders keep the same tokens at every position: the case shows nothing"
    other, _ = reference.token_logprobs(logits, targets, temperature=temperature, support=hf_order)  # [N]
    assert (other - sampled).abs().max().item() > 1e-3


def truncated(config: TrainConfig, **rule) -> TrainConfig:
    return dataclasses.replace(config, loss=dataclasses.replace(config.loss, **(rule or RULE)))


def check_replayed_run(history: list[dict]) -> None:
    """The guard passed (the sampler's log-probs equal the replayed π_old's), the correction's ratio is 1 and not
    the kept mass, which is logged below 1, with the loss's own replay metrics."""
    for record in history:
        assert record[f"{DIFF}/max"] <= 1e-5, record[f"{DIFF}/max"]
        assert abs(record[f"{RATIO}/mean"] - 1) <= 1e-5
        assert 0.0 < record[KEPT_MASS] < 0.999, record[KEPT_MASS]
        assert all(name in record for name in LOSS_REPLAY), sorted(record)
        assert record["sampling/log_kept_mass"] < 0.0 and record["sampling/outside_support"] == 0.0


def test_a_truncated_run_with_hf_rollouts_replays_and_logs_the_kept_mass(tmp_path):
    history = GRPOTrainer(truncated(vllm_demo(tmp_path, rollout="hf", device="auto"))).train()
    assert [r["step"] for r in history] == [1, 2]
    check_replayed_run(history)


@pytest.fixture
def cpu_vllm(monkeypatch):
    """The stand-in's CPU build, sampling from the demo's architecture with the pushed weights."""
    install_stand_in_cpu_build(monkeypatch)
    return monkeypatch


def test_a_truncated_run_with_vllm_rollouts_samples_and_replays_the_same_rule(cpu_vllm, tmp_path):
    history = GRPOTrainer(truncated(vllm_demo(tmp_path))).train()
    params = fake_vllm.LLM.built[-1].last_params[0]
    assert (params.kwargs["top_k"], params.kwargs["top_p"], params.kwargs["min_p"]) == (8, 0.9, 0.05)
    check_replayed_run(history)


def test_without_replaying_pi_old_the_guard_would_stop_a_truncated_run(cpu_vllm, tmp_path):
    """π_old over the whole vocabulary against the truncated sampler's log-probs: off by log S per token, which the
    guard reads as a sampler without the policy's weights. The replay is what keeps it quiet above. (The two-pass
    path: under one pass per step π_old is the update pass's own, replayed, log-probs.)"""
    cpu_vllm.setattr(sampling_replay, "truncates", lambda options: False)  # π_old's pass only; the loss still replays
    config = dataclasses.replace(truncated(vllm_demo(tmp_path)), old_logprobs="pass")
    with pytest.raises(StaleSampler, match=r"^step 1: the sampler's log-probs of its own tokens differ"):
        GRPOTrainer(config).train()


def test_without_truncation_vllm_gets_top_k_off_and_no_kept_mass_is_logged(cpu_vllm, tmp_path):
    history = GRPOTrainer(vllm_demo(tmp_path, steps=1)).train()
    assert fake_vllm.LLM.built[-1].last_params[0].kwargs["top_k"] == -1  # vLLM's "off"
    assert KEPT_MASS not in history[0] and not set(LOSS_REPLAY) & set(history[0])


@pytest.mark.parametrize("replay_reference", [False, True])
def test_the_reference_stays_full_vocabulary_unless_replayed(tmp_path, replay_reference):
    """At step 1 the reference is the policy: its KL to the replayed policy is 0 only when it is replayed too."""
    config = truncated(vllm_demo(tmp_path, rollout="hf", device="auto", steps=1), top_k=4)
    config = dataclasses.replace(config, replay_reference=replay_reference)
    assert config.loss.beta > 0.0
    (record,) = GRPOTrainer(config).train()
    assert (record["kl"] <= 1e-6) == replay_reference, record["kl"]


def test_replay_reference_without_truncation_is_refused():
    with pytest.raises(ValueError, match="replay_reference replays the sampler's truncation, but top_k, top_p"):
        check_config(dataclasses.replace(TrainConfig(), replay_reference=True))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--top-k", "-2"], "top_k must be an int >= 0"),
        (["--min-p", "1.0"], "min_p must be in [0, 1)"),
        (["--replay-reference"], "replay_reference replays the sampler's truncation"),
    ],
)
def test_a_truncation_mistake_on_the_command_line_is_one_error_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        train_main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and message in err, err


def test_pvpos_reference_rollouts_sample_with_the_policys_truncation(tmp_path):
    config = dataclasses.replace(vllm_demo(tmp_path, rollout="hf", device="auto"), preset="pvpo")
    trainer = GRPOTrainer(truncated(config))
    rollout = trainer.components.reference.rollout
    assert (rollout.temperature, rollout.top_k, rollout.top_p, rollout.min_p) == (config.loss.temperature, 8, 0.9, 0.05)

"""The TRL drop-in replays truncated sampling; stock TRL 1.16 does not (TRL #6789).

Both trainers run TRL's own `_generate_and_score_completions` on the same truncated samples
(`benchmarks/trl_replay_bias.py`: a `rollout_func` samples each token from a tiny model's distribution at temperature
T, truncated by the float64 oracle's `sampler_support`, and returns the log-prob renormalised over the kept set, as
vLLM's processed logprobs). Stock TRL's importance-sampling ratio is then each token's kept mass S (its log-probs are
full-vocabulary); the drop-in's is 1. The old, reference and training passes are held to the oracle too.
"""

import math

import pytest
import torch

trl = pytest.importorskip("trl")

import tests.test_trl as base  # noqa: E402
from benchmarks import trl_replay_bias as bias  # noqa: E402
from grpo_kernels import reference  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.integrations import trl_replay  # noqa: E402
from tests.conftest import assert_close  # noqa: E402

tokenizer = base.tokenizer  # test_trl's fixture: the same character-level tokenizer as the benchmark's model
T_SAMPLE, RATIO = bias.T_SAMPLE, bias.RATIO


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """The benchmark's tiny Qwen2 (lm_head scaled ×20: logits spread over a few nats, as a trained model's)."""
    return str(bias.write_model(tmp_path_factory.mktemp("replay_model")))


def test_the_drop_in_removes_the_kept_mass_from_the_importance_ratio(peaked_model):
    """top_k 5, top_p 0.9 and min_p 0.05 at T 0.7: stock TRL's mean importance-sampling ratio is the mean kept mass
    (0.87 here: the bias TRL #6789 names); the drop-in's ratio is 1 on every token: its old log-probs equal the
    sampler's processed ones. (`benchmarks.trl_replay_bias` prints the other rules.)"""
    rule = "top_k_top_p_min_p"
    stock, sampler = bias.sample_and_score(False, peaked_model, bias.RULES[rule])
    ours, same = bias.sample_and_score(True, peaked_model, bias.RULES[rule])
    assert same.kept_mass == sampler.kept_mass  # the same samples (seeded, same model)
    kept_mass = sum(sampler.kept_mass) / len(sampler.kept_mass)
    assert kept_mass < 0.95, f"the rule {bias.RULES[rule]} keeps {kept_mass:.3f} of the mass: too little truncation"
    assert math.isclose(stock[f"{RATIO}/mean"], kept_mass, rel_tol=1e-4), (stock[f"{RATIO}/mean"], kept_mass)
    assert math.isclose(stock[f"{RATIO}/min"], min(sampler.kept_mass), rel_tol=1e-4)
    for stat in ("min", "mean", "max"):
        assert abs(ours[f"{RATIO}/{stat}"] - 1.0) < 1e-5, (stat, ours[f"{RATIO}/{stat}"])
    assert ours["sampling/sampling_logp_difference/max"] < 1e-5
    mean_log_mass = sum(-math.log(s) for s in sampler.kept_mass) / len(sampler.kept_mass)
    assert math.isclose(stock["sampling/sampling_logp_difference/mean"], mean_log_mass, rel_tol=1e-4)


def _batch(trainer):
    inputs = base.make_inputs(trainer, old=False)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    return inputs, ids, attention


def _oracle_logp(model, ids, attention, rule: dict) -> torch.Tensor:
    """float64 log-probs of the completion tokens under `rule` (sampler_support on logits / T), 0 at padding."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -base.T - 1 : -1]  # [B, T, V]
    z = reference.transformed_logits(logits, temperature=T_SAMPLE)  # [B, T, V]
    support = reference.sampler_support(z, **rule)  # [B, T, V]
    logp, _ = reference.token_logprobs(logits, ids[:, -base.T :], temperature=T_SAMPLE, support=support)
    return logp * attention[:, -base.T :]  # [B, T]


@pytest.mark.parametrize("replay_reference", [False, True])
def test_the_reference_stays_full_vocabulary_unless_replay_reference(
    monkeypatch, peaked_model, tokenizer, replay_reference
):
    """The old log-prob pass (the policy) is replayed; the reference model's is TRL's full-vocabulary one, or
    replayed with `GRPOConfig(replay_reference=True)`."""
    rule = dict(top_k=5, top_p=0.8)
    config = dict(beta=0.04, temperature=T_SAMPLE, **rule)
    stock = base.build(trl.GRPOTrainer, peaked_model, tokenizer, **config)
    monkeypatch.setattr(trl, "GRPOConfig", drop_in.GRPOConfig)  # test_trl's `build` with the drop-in's config
    ours = base.build(drop_in.GRPOTrainer, peaked_model, tokenizer, replay_reference=replay_reference, **config)
    _, ids, attention = _batch(stock)
    with torch.no_grad():
        old = ours._get_per_token_logps_and_entropies(ours.model, ids, attention, base.T)[0]
        ref = ours._get_per_token_logps_and_entropies(ours.ref_model, ids, attention, base.T)[0]
        stock_ref = stock._get_per_token_logps_and_entropies(stock.ref_model, ids, attention, base.T)[0]
    assert_close(old, _oracle_logp(ours.model, ids, attention, rule).float(), torch.float32, "old logp")
    if replay_reference:
        assert_close(ref, _oracle_logp(ours.ref_model, ids, attention, rule).float(), torch.float32, "ref logp")
    else:
        assert_close(ref, stock_ref, torch.float32, "ref logp")
    assert (old - stock_ref).abs().max() > 0.1  # replay moved the policy's log-probs


def test_the_loss_replays_and_logs_the_kept_mass(peaked_model, tokenizer):
    """The training loss runs on replayed log-probs: its entropy metric is the kept set's entropy (the oracle's),
    and it logs the mean log kept mass beside TRL's metrics."""
    rule = dict(top_p=0.8)
    ours = base.build(drop_in.GRPOTrainer, peaked_model, tokenizer, temperature=T_SAMPLE, **rule)
    inputs, ids, attention = _batch(ours)
    _, _, metrics = base.step(ours, inputs)
    with torch.no_grad():
        logits = ours.model(input_ids=ids, attention_mask=attention).logits[:, -base.T - 1 : -1]  # [B, T, V]
    z = reference.transformed_logits(logits, temperature=T_SAMPLE)  # [B, T, V]
    support = reference.sampler_support(z, **rule)  # [B, T, V]
    _, entropy = reference.token_logprobs(logits, ids[:, -base.T :], temperature=T_SAMPLE, support=support)
    kept = inputs["completion_mask"].bool()  # [B, T]
    assert math.isclose(metrics["entropy"], float(entropy[kept].mean()), rel_tol=1e-5)
    counted = support | torch.nn.functional.one_hot(ids[:, -base.T :], z.shape[-1]).bool()  # the target counts as kept
    log_mass = torch.logsumexp(z.masked_fill(~counted, -math.inf), -1) - torch.logsumexp(z, -1)  # [B, T]
    assert math.isclose(metrics["sampling/log_kept_mass"], float(log_mass[kept].mean()), rel_tol=1e-4)


def test_the_sampler_rule_from_the_config():
    """GRPOConfig's names and TRL's off values (top_k 0, vLLM's -1; min_p None), generation_kwargs over them."""
    cpu = dict(output_dir=base.OUTPUT_DIR, report_to=[], use_cpu=True, bf16=False)
    config = lambda **fields: trl.GRPOConfig(**cpu, **fields)  # noqa: E731
    assert trl_replay.sampling_rule(config()) == trl_replay.RULE_OFF
    assert trl_replay.sampling_rule(config(top_k=-1, min_p=None)) == trl_replay.RULE_OFF
    rule = trl_replay.sampling_rule(config(top_p=0.9, generation_kwargs={"top_p": 0.7, "min_p": 0.1}))
    assert rule == {"top_k": 0, "top_p": 0.7, "min_p": 0.1}


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(top_p=0.9, min_p=0.1), "applies min-p after top-p"),
        (dict(generation_kwargs={"typical_p": 0.9}), "typical_p"),
        (dict(generation_kwargs={"top_p": 1.5}), "top_p must be in"),
        (dict(top_k=-3), "top_k must be an int"),
        (dict(min_p=1.0), r"^min_p must be in \[0, 1\) \(0.0: off\), got 1.0$"),  # LossOptions' message
    ],
)
def test_a_sampler_the_replay_cannot_reproduce_raises(tokenizer, peaked_model, fields, match):
    """transformers' generate (use_vllm=False) applies min-p last, and has truncations the replay lacks: the
    drop-in refuses at construction, naming the option (stock TRL runs them, unreplayed); so does a value the loss
    would refuse, with the loss's message."""
    with pytest.raises(ValueError, match=match):
        base.build(drop_in.GRPOTrainer, peaked_model, tokenizer, **fields)


def test_a_replaying_pass_takes_the_fast_route(monkeypatch, peaked_model, tokenizer):
    """Where the agreed memory mode is "lean" (little free memory), which cannot replay, a replaying pass runs "fast"
    (every rank replays the same rule, so they agree); a pass without truncation keeps the agreed mode."""
    routes = []
    monkeypatch.setattr(trl_replay, "agreed_memory", lambda weight, mask: routes.append("asked") or "lean")
    ours = base.build(drop_in.GRPOTrainer, peaked_model, tokenizer, temperature=T_SAMPLE, top_p=0.8, beta=0.04)
    _, ids, attention = _batch(ours)
    loss, _, _ = base.step(ours, base.make_inputs(ours, old=False, ref=True))
    with torch.no_grad():
        ours._get_per_token_logps_and_entropies(ours.model, ids, attention, base.T)  # the policy: replayed, fast
        assert routes == []
        ours._get_per_token_logps_and_entropies(ours.ref_model, ids, attention, base.T)  # the reference: lean
    assert routes == ["asked"] and torch.isfinite(loss)


def test_a_peft_reference_pass_stays_full_vocabulary(peaked_model, tokenizer):
    """LoRA without a reference model: TRL takes the reference log-probs from the policy with its adapters disabled
    (`use_adapter(model, None)`); that pass is the reference's (not replayed), the policy's is replayed."""
    peft = pytest.importorskip("peft")
    from trl.trainer.utils import use_adapter

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    ours = base.build(drop_in.GRPOTrainer, peaked_model, tokenizer, peft_config=lora, beta=0.04, top_p=0.8)
    assert ours.ref_model is None
    assert trl_replay.pass_rule(ours, ours.model) == {"top_k": 0, "top_p": 0.8, "min_p": 0.0}
    with use_adapter(ours.accelerator.unwrap_model(ours.model), adapter_name=None):
        assert trl_replay.pass_rule(ours, ours.model) == trl_replay.RULE_OFF
    assert trl_replay.pass_rule(ours, ours.model)["top_p"] == 0.8  # adapters back on

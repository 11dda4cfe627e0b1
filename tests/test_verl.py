"""grpo_kernels.integrations.verl against verl itself (0.9.1): every registered loss equals verl's function of the
same kind over every loss_agg_mode, local and global batch info, with and without rollout IS weights (loss, gradient
w.r.t. log_prob, metrics); the abs KL estimator equals verl's kl_penalty; the fused entry point equals verl's torch
path (log-probs, entropy, gradients w.r.t. hidden and weight), also called from verl's own model forward."""

import sys
from types import ModuleType

import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos", reason='verl is not installed: pip install "grpo-kernels[verl]"'
)

from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.integrations import verl as gk_verl  # noqa: E402
from grpo_kernels.losses.kl import KL_ESTIMATORS  # noqa: E402
from grpo_kernels.losses.loss import compute_loss  # noqa: E402
from grpo_kernels.losses.terms import build_terms  # noqa: E402
from grpo_kernels.options import CLIP_LOSS_TYPES, LOSS_AGG_MODES  # noqa: E402
from tests.conftest import assert_close  # noqa: E402

B, T = 6, 9
F32 = torch.float32
# (our loss type, verl's loss of the same kind)
PAIRS = [
    *[(t, "vanilla") for t in CLIP_LOSS_TYPES],  # they differ only in their normaliser, which loss_agg_mode sets
    ("gspo_token", "gspo"),
    ("sapo", "sapo"),
    ("gpg", "gpg"),
    ("cispo", "cispo"),
    ("gmpo", "geo_mean"),
    ("clip_cov", "clip_cov"),
    ("kl_cov", "kl_cov"),
    ("dppo_tv", "dppo_tv"),
    ("dppo_kl", "dppo_kl"),
    ("dro", "dro"),
]
CONFIGS = {
    "defaults": dict(policy_loss=dict(dro_beta=0.1)),  # dro_beta has no default: verl's dro needs one
    # dual clip binding on many A < 0 tokens; clip_cov / kl_cov choosing several tokens out of many candidates
    "tight": dict(
        clip_ratio_c=1.1,
        clip_ratio_high=0.28,
        tau_pos=0.8,
        tau_neg=1.3,
        policy_loss=dict(
            clip_cov_ratio=0.1, clip_cov_lb=0.2, clip_cov_ub=3.0, kl_cov_ratio=0.2, ppo_kl_coef=1.0, dro_beta=1.5
        ),
    ),
    # DPPO's TV / KL trust regions masking tokens on both sides, its IS weight truncated
    "divergence": dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=1.2, policy_loss=dict(dro_beta=0.4)),
}
BATCH_INFO = {
    "local": {},
    "global": dict(dp_size=2, batch_num_tokens=97, global_batch_size=13, loss_scale_factor=16),
}


def actor_config(loss_agg_mode: str, policy_loss: dict | None = None, batch_info: dict | None = None, **fields):
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(**(policy_loss or {})),
        **fields,
    )
    config.global_batch_info.update(batch_info or {})
    return config


def verl_inputs(seed: int, per_token_advantages: bool = False, dtype=F32) -> dict:
    """[B, T] inputs as verl's actor hands them: ragged rows, one fully masked, garbage at padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 0, 7, 1, 6])
    mask = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    log_prob = -(2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)) - 0.1  # [B, T]
    old = log_prob + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    adv = torch.randn(B, T, generator=g) if per_token_advantages else torch.randn(B, 1, generator=g).expand(B, T)
    weights = torch.exp(0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))  # [B, T]
    garbage = ~mask
    old, log_prob = old.masked_fill(garbage, 7.0), log_prob.masked_fill(garbage, -3.0)
    return dict(
        old_log_prob=old.to(dtype),
        log_prob=log_prob.to(dtype),
        advantages=adv.to(dtype).clone(),
        response_mask=mask,
        rollout_is_weights=weights.to(dtype),
    )


def run(fn, inputs: dict, config, loss_agg_mode: str, is_weights: bool, seed: int = 0):
    """(loss, dloss/dlog_prob, metrics) of one policy-loss call; torch seeded first (clip_cov's draw)."""
    log_prob = inputs["log_prob"].clone().requires_grad_()
    torch.manual_seed(seed)
    loss, metrics = fn(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=inputs["rollout_is_weights"] if is_weights else None,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss, grad, metrics


@pytest.fixture(scope="module")
def registered():
    names = gk_verl.register()
    yield names
    for name in names:
        core_algos.POLICY_LOSS_REGISTRY.pop(name)


@pytest.mark.parametrize("batch_info", BATCH_INFO)
@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type,verl_name", PAIRS)
def test_loss_equals_verl(registered, loss_type, verl_name, loss_agg_mode, config_name, batch_info):
    config = actor_config(loss_agg_mode, batch_info=BATCH_INFO[batch_info], **CONFIGS[config_name])
    ours_fn = core_algos.get_policy_loss_fn(f"gk_{loss_type}")
    theirs_fn = core_algos.get_policy_loss_fn(verl_name)
    per_token = loss_type not in ("gmpo",)  # verl's geo_mean takes sequence-level advantages only
    for seed, is_weights in ((1, False), (2, True)):
        inputs = verl_inputs(seed, per_token_advantages=per_token and seed == 2)
        loss, grad, metrics = run(ours_fn, inputs, config, loss_agg_mode, is_weights)
        ref_loss, ref_grad, ref_metrics = run(theirs_fn, inputs, config, loss_agg_mode, is_weights)
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert_close(loss, ref_loss, F32, "loss")
        assert_close(grad, ref_grad, F32, "grad log_prob")
        assert set(ref_metrics) <= set(metrics), (sorted(ref_metrics), sorted(metrics))
        for name, value in ref_metrics.items():
            assert_close(torch.tensor(metrics[name]), torch.tensor(value), F32, name)


def test_clip_cov_draw_is_verls_and_seeded():
    """clip_cov picks its tokens with verl's torch.randperm on the default generator: same seed, same tokens (and
    the same RNG state afterwards); another seed, other tokens."""
    config = actor_config("token-sum", **CONFIGS["tight"])
    fn = gk_verl.policy_loss_fn("clip_cov")
    inputs = verl_inputs(3)
    grads = {}
    for seed in (0, 0, 1):
        loss, grad, _ = run(fn, inputs, config, "token-sum", False, seed=seed)
        after_ours = torch.rand(1)
        _, ref_grad, _ = run(core_algos.compute_policy_loss_clip_cov, inputs, config, "token-sum", False, seed=seed)
        assert torch.equal(torch.rand(1), after_ours)  # verl's draw advanced the RNG exactly as ours did
        assert_close(grad, ref_grad, F32, "grad log_prob")
        grads.setdefault(seed, []).append(grad)
    assert torch.equal(*grads[0]) and not torch.equal(grads[0][0], grads[1][0])


def test_abs_kl_equals_verl():
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    terms = build_terms(
        logp, ref_logp=ref, advantages=torch.zeros(B), mask=torch.ones(B, T), options=gk.LossOptions(kl_estimator="abs")
    )
    expected = core_algos.kl_penalty(logp, ref, "abs")
    torch.testing.assert_close(KL_ESTIMATORS["abs"](terms), expected, rtol=0, atol=0)


def test_gmpo_is_ratio_is_a_geometric_mean():
    """gmpo with a per-token is_ratio equals gmpo with each sequence's geometric mean of it (verl geo_mean)."""
    inputs = verl_inputs(4)
    mask = inputs["response_mask"]
    w = inputs["rollout_is_weights"]
    geo = torch.exp(((w + 1e-10).log() * mask).sum(-1) / mask.sum(-1).clamp(min=1))  # [B]
    options = gk.LossOptions(loss_type="gmpo")
    args = dict(old_logp=inputs["old_log_prob"], advantages=inputs["advantages"][:, 0], mask=mask, options=options)
    per_token = compute_loss(build_terms(inputs["log_prob"], is_ratio=w, **args), options)[0].loss
    per_sequence = compute_loss(build_terms(inputs["log_prob"], is_ratio=geo, **args), options)[0].loss
    assert_close(per_token, per_sequence, F32, "loss")


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_every_registered_loss_runs(registered, loss_agg_mode):
    """The losses verl has no counterpart of (vespo, tic_grpo) run too: finite loss and gradient, verl's metric keys."""
    config = actor_config(loss_agg_mode, batch_info=BATCH_INFO["global"], policy_loss=dict(dro_beta=0.1))
    for name in registered:
        loss, grad, metrics = run(core_algos.get_policy_loss_fn(name), verl_inputs(7), config, loss_agg_mode, True)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
        assert "actor/ppo_kl" in metrics and all(k.startswith("actor/") for k in metrics), name


def test_register_names_and_refusals(registered):
    assert set(registered) == {f"gk_{t}" for t in gk.LOSS_TYPES}
    verls = {"vanilla", "gspo", "sapo", "gpg", "cispo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"}
    assert not set(registered) & verls
    assert core_algos.get_policy_loss_fn("gk_dapo").grpo_kernels_loss_type == "dapo"
    with pytest.raises(TypeError, match="beta"):
        gk_verl.register(beta=0.04)
    with pytest.raises(ValueError, match="delta"):
        gk_verl.register(loss_types=("cispo",), delta=4.0)
    with pytest.raises(ValueError, match="already holds 'vanilla'"):
        gk_verl.register(loss_types=("vanilla",), prefix="")  # verl's own name


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_bypass_mode_is_the_trainers_choice_of_old_log_probs(registered, loss_agg_mode):
    """verl's bypass_mode loss (ppo_clip, no rejection sampling) on old = rollout log-probs is gk_grpo on the same
    tensors: bypass changes which log-probs the trainer passes as old (and adds verl's rollout-correction
    metrics), not the loss; docs/verl.md says why it stays verl's."""
    from omegaconf import OmegaConf

    config = actor_config(loss_agg_mode)
    rollout_correction = dict(loss_type="ppo_clip", rollout_is="sequence", rollout_rs=None)
    bypass = OmegaConf.create(dict(loss_mode="bypass_mode", rollout_correction=rollout_correction))
    object.__setattr__(config, "policy_loss", bypass)  # what verl's apply_bypass_mode writes into the actor config
    inputs = verl_inputs(5)  # old_log_prob plays the rollout log-probs
    loss, grad, metrics = run(core_algos.get_policy_loss_fn("gk_grpo"), inputs, config, loss_agg_mode, False)
    theirs = core_algos.get_policy_loss_fn("bypass_mode")
    ref_loss, ref_grad, ref_metrics = run(theirs, inputs, config, loss_agg_mode, False)
    assert_close(loss, ref_loss, F32, "loss")
    assert_close(grad, ref_grad, F32, "grad log_prob")
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert_close(torch.tensor(metrics[name]), torch.tensor(ref_metrics[name]), F32, name)


def test_extra_options_reach_the_loss():
    """A fixed extra option (importance_sampling_level) is used: sequence-level grpo is GSPO's ratio."""
    config = actor_config("seq-mean-token-mean")
    inputs = verl_inputs(6)
    sequence = gk_verl.policy_loss_fn("grpo", importance_sampling_level="sequence")
    loss, _, _ = run(sequence, inputs, config, "seq-mean-token-mean", False)
    token, _, _ = run(gk_verl.policy_loss_fn("grpo"), inputs, config, "seq-mean-token-mean", False)
    assert not torch.allclose(loss, token)


# ------------------------------------------------------------------------------------- fused log-prob + entropy


def fused_inputs(seed: int, V: int = 150, H: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (2, 5), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_cross_entropy_equals_verl_torch_path(temperature, reduction):
    hidden, weight, labels = fused_inputs(0)
    g = torch.Generator().manual_seed(1)
    d_logp, d_ent = torch.randn(2 * 5, generator=g), torch.randn(2 * 5, generator=g)
    results = []
    for ours in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if ours:
            logp, ent = gk_verl.linear_cross_entropy(h, w, labels, temperature, reduction)
        else:
            logp, ent = FusedLinearForPPOFunction.apply(h, w, labels, temperature, 4)  # [2, 5] each
            logp, ent = logp.reshape(-1), ent.reshape(-1)
            logp = {"none": logp, "sum": logp.sum(), "mean": logp.mean()}[reduction]
        assert logp.dtype == ent.dtype == F32 and ent.shape == (10,)
        objective = (logp * (d_logp if reduction == "none" else 1.3)).sum() + (ent * d_ent).sum()
        results.append((logp, ent, *torch.autograd.grad(objective, (h, w))))
    for name, ours, theirs in zip(("logprobs", "entropy", "grad hidden", "grad weight"), *results, strict=True):
        assert ours.shape == theirs.shape, name
        assert_close(ours, theirs, F32, name)


def test_linear_cross_entropy_reduction_and_one_rank_group(monkeypatch):
    """A bad reduction is refused; a group of one rank holds the whole vocabulary. (A vocabulary-sharded weight
    over 2 ranks, verl's dist_process_group meaning, is held to one process in tests/test_vocab_parallel.py.)"""
    hidden, weight, labels = fused_inputs(0)
    group = object()
    with pytest.raises(ValueError, match="reduction"):
        gk_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "max")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)  # the whole vocabulary
    logp, _ = gk_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none", group)
    assert_close(logp, gk_verl.linear_cross_entropy(hidden, weight, labels)[0], F32, "logprobs")


def test_patch_fused_kernels_reaches_verls_model_forward(monkeypatch):
    """After patch_fused_kernels, verl's own triton-backend model forward (use_fused_kernels) runs ours, on CPU,
    and equals its torch backend; modules that imported verl's function before are patched too; unpatch restores."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.models.transformers.dense_common import forward_with_torch_backend, forward_with_triton_backend
    from verl.utils.kernel import linear_cross_entropy as home

    original = home.linear_cross_entropy
    importer = ModuleType("verl._gk_test_importer")
    importer.linear_cross_entropy = original
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(0, 97, (2, 6))
    gk_verl.patch_fused_kernels()
    try:
        gk_verl.patch_fused_kernels()  # idempotent
        assert home.linear_cross_entropy is gk_verl.linear_cross_entropy
        assert importer.linear_cross_entropy is gk_verl.linear_cross_entropy
        ours = forward_with_triton_backend(model, input_ids=input_ids, return_dict=True, temperature=0.8)
    finally:
        gk_verl.unpatch_fused_kernels()
    assert home.linear_cross_entropy is original and importer.linear_cross_entropy is original
    theirs = forward_with_torch_backend(model, input_ids=input_ids, return_dict=True, temperature=0.8)
    assert_close(ours.log_probs, theirs.log_probs.reshape(-1), F32, "logprobs")
    assert_close(ours.entropy, theirs.entropy.reshape(-1), F32, "entropy")


def test_missing_verl_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(ImportError, match=r"grpo-kernels\[verl\]"):
        gk_verl.register()

"""verl's fused log-prob entry point replays the rollout's truncated sampling: `linear_cross_entropy(top_k=,
top_p=)` equals the float64 oracle over the sampler's kept set (log-probs, entropy, gradients w.r.t. hidden and
weight), and `patch_fused_kernels(rollout=...)` makes verl's own model forward return them, from verl's rollout
config names (top_k -1 and top_p 1.0: off)."""

import math

import pytest
import torch

pytest.importorskip(
    "verl.utils.kernel.linear_cross_entropy", reason='verl is not installed: pip install "grpo-kernels[verl]"'
)

from verl.workers.config.rollout import SamplingConfig  # noqa: E402

from grpo_kernels import reference  # noqa: E402
from grpo_kernels.integrations import verl as gk_verl  # noqa: E402
from tests.conftest import assert_close  # noqa: E402

F32 = torch.float32
RULES = [dict(top_k=5), dict(top_p=0.7), dict(top_k=20, top_p=0.9)]


def oracle(hidden, weight, labels, temperature, rule):
    """float64 (logp, entropy) [N] over the kept set of softmax((hidden @ weight.T) / T), and their gradients."""
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = h.reshape(-1, h.shape[-1]) @ w.T  # [N, V]
    z = reference.transformed_logits(logits.detach(), temperature=temperature)  # [N, V]
    support = reference.sampler_support(z, **rule)  # [N, V]
    logp, entropy = reference.token_logprobs(logits, labels.reshape(-1), temperature=temperature, support=support)
    return logp, entropy, h, w


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}{v}" for k, v in r.items()))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_cross_entropy_replays_the_rule(rule, temperature):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 16, generator=g), torch.randn(150, 16, generator=g) / 2
    labels = torch.randint(0, 150, (2, 5), generator=g)
    labels[0] = (hidden[0] @ weight.T).argmax(-1)  # kept by any rule; row 1's are mostly cut (counted as kept)
    d_logp, d_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = gk_verl.linear_cross_entropy(h, w, labels, temperature, "none", **rule)
    grads = torch.autograd.grad((logp * d_logp).sum() + (entropy * d_ent).sum(), (h, w))
    want_logp, want_entropy, h64, w64 = oracle(hidden, weight, labels, temperature, rule)
    want_grads = torch.autograd.grad((want_logp * d_logp).sum() + (want_entropy * d_ent).sum(), (h64, w64))
    assert_close(logp, want_logp.float(), F32, "logprobs")
    assert_close(entropy, want_entropy.float(), F32, "entropy")
    for name, got, want in zip(("grad hidden", "grad weight"), grads, want_grads, strict=True):
        assert_close(got, want.float(), F32, name)
    full, _ = gk_verl.linear_cross_entropy(hidden, weight, labels, temperature)
    assert (logp - full).min() > 0.01  # every target's log-prob rose: the kept mass was < 1 at every position


@pytest.mark.parametrize(
    "rollout", [{"top_k": 5, "top_p": 0.8}, SamplingConfig(top_k=5, top_p=0.8)], ids=["mapping", "verl_config"]
)
def test_patch_replays_the_rollout_config_in_verls_model_forward(rollout):
    """verl's own triton-backend forward (use_fused_kernels), patched with the rollout config, returns the replayed
    log-probs of the oracle; unpatched, verl's function is back."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.models.transformers.dense_common import forward_with_triton_backend
    from verl.utils.kernel import linear_cross_entropy as home

    original = home.linear_cross_entropy
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits over a few nats: truncation keeps part of the mass
    input_ids = torch.randint(0, 97, (2, 6))
    gk_verl.patch_fused_kernels(rollout=rollout)
    try:
        assert gk_verl._is_ours(home.linear_cross_entropy)
        with torch.no_grad():
            ours = forward_with_triton_backend(model, input_ids=input_ids, return_dict=True, temperature=0.8)
    finally:
        gk_verl.unpatch_fused_kernels()
    assert home.linear_cross_entropy is original
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [2, 6, V]
    z = reference.transformed_logits(logits, temperature=0.8)  # [2, 6, V]
    support = reference.sampler_support(z, top_k=5, top_p=0.8)  # [2, 6, V]
    labels = torch.roll(input_ids, shifts=-1, dims=-1)  # verl's rolled labels
    logp, entropy = reference.token_logprobs(logits, labels, temperature=0.8, support=support)
    assert_close(ours.log_probs, logp.reshape(-1).float(), F32, "logprobs")
    assert_close(ours.entropy, entropy.reshape(-1).float(), F32, "entropy")
    assert not math.isclose(float(support.double().mean()), 1.0)


def test_rollout_rule_names_verls_fields():
    assert gk_verl.rollout_rule(None) == {"top_k": 0, "top_p": 1.0}
    assert gk_verl.rollout_rule(SamplingConfig()) == {"top_k": 0, "top_p": 1.0}  # verl's defaults: off
    assert gk_verl.rollout_rule({"top_k": 50, "top_p": 0.95}) == {"top_k": 50, "top_p": 0.95}
    with pytest.raises(ValueError, match=r"rollout\.top_k must be an int >= 0 \(0: off\), got -5"):
        gk_verl.rollout_rule({"top_k": -5})
    with pytest.raises(ValueError, match=r"rollout\.top_p must be in \(0, 1\]"):
        gk_verl.rollout_rule({"top_p": 0.0})
    with pytest.raises(TypeError, match=r"rollout\.top_p must be a float, got str"):
        gk_verl.rollout_rule({"top_p": "0.9"})


def _tensor_parallel_worker(rank: int, store: str, queue, world: int) -> None:
    import traceback

    try:
        import torch.distributed as dist

        from tests.rendezvous import join

        join(rank, world, store)
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(2, 5, 16, generator=g), torch.randn(150, 16, generator=g) / 2
        labels = torch.randint(0, 150, (2, 5), generator=g)
        shard = weight.chunk(world)[rank]  # [V / world, H]: this rank's rows of the lm_head, verl's meaning
        with pytest.raises(ValueError, match=r"top_p=0.9 on vocabulary shards .* needs top_k in \[1, 1024\]"):
            gk_verl.linear_cross_entropy(hidden, shard, labels, 0.8, "none", dist.group.WORLD, top_p=0.9)
        rule = dict(top_k=20, top_p=0.9)
        logp, entropy = gk_verl.linear_cross_entropy(hidden, shard, labels, 0.8, "none", dist.group.WORLD, **rule)
        want_logp, want_entropy, _, _ = oracle(hidden, weight, labels, 0.8, rule)
        assert_close(logp, want_logp.detach().float(), F32, "logprobs")
        assert_close(entropy, want_entropy.detach().float(), F32, "entropy")
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def test_tensor_parallel_shards_replay_together():
    """verl's `dist_process_group` (Megatron's vocabulary-parallel lm_head) on 2 gloo ranks: the shards' replayed
    log-probs and entropy equal the oracle's on the whole vocabulary; top_p without a top_k bound is refused."""
    from tests.rendezvous import spawn_ranks

    spawn_ranks(_tensor_parallel_worker, 2, 2)

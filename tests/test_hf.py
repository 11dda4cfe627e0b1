"""Hugging Face helper: tiny Llama / Qwen2 / Gemma 2 / Cohere / Granite models built from a config (no download);
the fused path, with the model's logit transform (soft-capping, scaling), equals the eager path through
model(...).logits, for log-probs and for the loss's gradients on every parameter."""

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.integrations.hf import (  # noqa: E402
    completion_hidden_states,
    lm_head,
    logit_transform,
    policy_logprobs,
)
from grpo_kernels.packing import PackedSequences  # noqa: E402
from tests.conftest import BACKENDS, assert_close  # noqa: E402

P, T, VOCAB = 4, 6, 97
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
MODELS = {  # the random models' logits are ~0.4, so a soft-cap of 0.3 bends them well into the tanh
    "llama_tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, tie_word_embeddings=False)),
    "gemma2_softcap": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=0.3)
    ),
    "cohere_scaled": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(**SIZES, logit_scale=2.5)),
    "granite_scaled": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(**SIZES, logits_scaling=0.2)),
}


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, P + T), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding of a short prompt
    completion_mask = torch.ones(3, T, dtype=torch.bool)
    completion_mask[1, 4:] = False  # a completion that ended early
    return input_ids, attention_mask, completion_mask


def eager_logprobs(model, input_ids, attention_mask, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1]  # [B, T, V]
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, input_ids[:, -T:, None]).squeeze(-1)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_logprobs_match_eager(name, backend):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    input_ids, attention_mask, completion_mask = batch()
    with torch.no_grad():
        fused = policy_logprobs(model, input_ids, attention_mask, completion_mask, temperature=0.8, backend=backend)
        eager = eager_logprobs(model, input_ids, attention_mask, temperature=0.8)
    assert_close(fused, eager * completion_mask, torch.float32, "logp")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_gradients_on_parameters_match_eager(name, backend):
    torch.manual_seed(0)
    model = MODELS[name]()
    input_ids, attention_mask, completion_mask = batch(1)
    targets = input_ids[:, -T:]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        logp = eager_logprobs(model, input_ids, attention_mask).float()
    advantages = torch.randn(3, generator=g)
    old, ref = logp + 0.2 * torch.randn(3, T, generator=g), logp + 0.3 * torch.randn(3, T, generator=g)
    options = dict(loss_type="dapo", epsilon_high=0.28, beta=0.04)

    weight, bias = lm_head(model)
    logit_scale, softcap = logit_transform(model)
    hidden = completion_hidden_states(model, input_ids, attention_mask, T)
    transform = dict(logit_scale=logit_scale, final_logit_softcapping=softcap)
    gk.fused_linear_grpo_loss(
        hidden,
        weight,
        targets,
        advantages,
        old,
        ref,
        completion_mask,
        bias=bias,
        backend=backend,
        **options,
        **transform,
    ).loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1]
    gk.grpo_loss(logits, targets, advantages, old, ref, completion_mask, backend="torch", **options).loss.backward()
    for n, p in model.named_parameters():
        assert_close(fused[n], p.grad, torch.float32, f"grad {n}")


CONFIGS = {  # name -> (config, (logit_scale, final_logit_softcapping)) as TRL 1.16's add_fused_lm_head reads them
    "llama": (lambda: transformers.LlamaConfig(**SIZES), (1.0, None)),
    "gemma2_default": (lambda: transformers.Gemma2Config(**SIZES, head_dim=8), (1.0, 30.0)),
    "gemma3_text": (lambda: transformers.Gemma3TextConfig(**SIZES, head_dim=8), (1.0, None)),
    "gemma3_composite": (
        lambda: transformers.Gemma3Config(text_config=dict(**SIZES, head_dim=8, final_logit_softcapping=7.0)),
        (1.0, 7.0),
    ),
    "cohere_default": (lambda: transformers.CohereConfig(**SIZES), (0.0625, None)),
    "cohere_none": (lambda: transformers.CohereConfig(**SIZES, logit_scale=None), (1.0, None)),
    "granite": (lambda: transformers.GraniteConfig(**SIZES, logits_scaling=8.0), (0.125, None)),
    "falcon_h1": (lambda: transformers.FalconH1Config(lm_head_multiplier=0.5), (0.5, None)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_logit_transform_reads_the_config(name):
    make_config, expected = CONFIGS[name]
    assert logit_transform(SimpleNamespace(config=make_config())) == expected


def test_prompt_is_required():
    model = MODELS["llama_tied"]()
    input_ids, attention_mask, completion_mask = batch()
    with pytest.raises(ValueError, match="prompt"):
        policy_logprobs(model, input_ids[:, -T:], attention_mask[:, -T:], completion_mask)


@pytest.mark.parametrize("name", MODELS)
def test_packed_layout_gives_the_padded_logprobs(name):
    """`policy_logprobs` and `completion_hidden_states` on a `PackedSequences` (one row of the real tokens, the
    model's own attention reading the restarting positions), with each model's logit transform: the padded
    log-probs and entropies at the kept completion tokens."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    input_ids, attention_mask, completion_mask = batch()
    attention_mask[:, P:] = completion_mask  # a completion ends where its mask does
    packed = PackedSequences.from_padded(input_ids, attention_mask, T)
    with torch.no_grad():
        padded = policy_logprobs(model, input_ids, attention_mask, completion_mask, temperature=0.8, with_entropy=True)
        got = policy_logprobs(model, packed, temperature=0.8, with_entropy=True)
        hidden = completion_hidden_states(model, packed)
    assert packed.input_ids.numel() == int(attention_mask.sum()) and hidden.shape == (int(completion_mask.sum()), 32)
    for g, want, what in zip(got, padded, ("logp", "entropy"), strict=True):
        assert_close(packed.unpack(g), want, torch.float32, what)

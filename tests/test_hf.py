"""Hugging Face helper: tiny Llama / Qwen2 models built from a config (no download); the fused path equals the
eager path through model(...).logits, for log-probs and for the loss's gradients on every parameter."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.hf import completion_hidden_states, lm_head, policy_logprobs  # noqa: E402
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
MODELS = {
    "llama_tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, tie_word_embeddings=False)),
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
    hidden = completion_hidden_states(model, input_ids, attention_mask, T)
    gk.fused_linear_grpo_loss(
        hidden, weight, targets, advantages, old, ref, completion_mask, bias=bias, backend=backend, **options
    ).loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1]
    gk.grpo_loss(logits, targets, advantages, old, ref, completion_mask, backend="torch", **options).loss.backward()
    for n, p in model.named_parameters():
        assert_close(fused[n], p.grad, torch.float32, f"grad {n}")


def test_logit_transforms_are_refused():
    config = transformers.Gemma2Config(**SIZES, head_dim=8)
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        lm_head(model)


def test_prompt_is_required():
    model = MODELS["llama_tied"]()
    input_ids, attention_mask, completion_mask = batch()
    with pytest.raises(ValueError, match="prompt"):
        policy_logprobs(model, input_ids[:, -T:], attention_mask[:, -T:], completion_mask)

"""Hugging Face causal LMs without their logits: the completion positions' final hidden states and the lm_head.

For Llama, Qwen2/3, Mistral, Gemma and any `*ForCausalLM` whose logits are `lm_head(final_hidden)`: the decoder
runs as usual, the lm_head never does; `policy_logprobs` then takes the fused lm_head + vocabulary pass.
Layout (TRL's): `input_ids = prompt ‖ completion`, `[B, P + T]`; `completion_mask [B, T]` covers the last T.
"""

from __future__ import annotations

from torch import Tensor, nn

from grpo_kernels.api import fused_linear_token_logprobs

# config attributes that change logits beyond lm_head(h): soft-capping (Gemma 2/3), scaling (Cohere, Granite)
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def lm_head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The output projection's (weight [V, H], bias [V] | None); tied embeddings give the embedding matrix.

    Raises ValueError for models whose logits are not a plain linear map of the final hidden state.
    """
    config = getattr(model, "config", None)
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"{type(model).__name__} transforms its logits ({name}={value}); the fused lm_head does not apply "
                "that transform: compute logits with the model and use grpo_loss instead"
            )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__}'s output embeddings are {type(head).__name__}, not an nn.Linear")
    return head.weight, head.bias


def completion_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, num_completion: int):
    """Final hidden states [B, T, H] at the positions that predict the last `num_completion` tokens."""
    decoder = model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, -num_completion - 1 : -1]  # position p predicts token p + 1


def policy_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(completion token) [B, T] (and entropy) for a causal LM, through the fused lm_head: no [B, T, V]
    logits. Differentiable w.r.t. the model's parameters; 0 where `completion_mask` is 0."""
    num_completion = completion_mask.shape[1]
    if input_ids.shape[1] <= num_completion:
        raise ValueError(
            f"input_ids must hold a prompt before the {num_completion} completion tokens, got {list(input_ids.shape)}"
        )
    weight, bias = lm_head(model)
    hidden = completion_hidden_states(model, input_ids, attention_mask, num_completion)  # [B, T, H]
    return fused_linear_token_logprobs(
        hidden,
        weight,
        input_ids[:, -num_completion:],
        bias=bias,
        temperature=temperature,
        with_entropy=with_entropy,
        mask=completion_mask,
        chunk_size=chunk_size,
        backend=backend,
    )

"""Hugging Face causal LMs without their logits: the completion positions' final hidden states and the lm_head.

For any `*ForCausalLM` whose logits are `lm_head(final_hidden)`, optionally scaled and soft-capped (Llama, Qwen2/3,
Mistral, Gemma 2/3, Cohere, Granite, Falcon-H1, ...): the decoder runs as usual, the lm_head never does;
`policy_logprobs` then takes the fused lm_head + vocabulary pass, which applies the model's logit transform.
Padded layout (TRL's): `input_ids = prompt ‖ completion`, `[B, P + T]`; `completion_mask [B, T]` covers the last T.
Packed layout (padding-free): a `PackedSequences` in place of `input_ids`, and no masks; the decoder runs on one
row of every sequence's real tokens (`attention.py`: flash-attn's varlen kernels, or a block-diagonal mask).
"""

from __future__ import annotations

import sys

from torch import Tensor, nn

from grpo_kernels.api import fused_linear_token_logprobs
from grpo_kernels.integrations.attention import varlen_kwargs
from grpo_kernels.packing import PackedSequences


def logit_transform(model: nn.Module) -> tuple[float, float | None]:
    """(logit_scale, final_logit_softcapping) of a causal LM, read from its (text) config as TRL 1.16 reads it.

    The model's logits are `c·tanh(s·lm_head(h)/c)` (just `s·lm_head(h)` when c is None):
    - soft-capping c: `final_logit_softcapping` (Gemma 2, Gemma 3 when set);
    - scale s: `logit_scale` (Cohere; None means unscaled), else `output_multiplier`, else `lm_head_multiplier`
      (Falcon-H1), else `logits_scaling`, by which Granite divides (s = 1/x) and HyperCLOVA X multiplies;
      1.0 when none is set.
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = getattr(text, name, None)
        if scale is not None:
            break
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scaling = text.logits_scaling
        scale = scaling if getattr(text, "model_type", None) == "hyperclovax" else 1 / scaling
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))


def lm_head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The output projection's (weight [V, H], bias [V] | None); tied embeddings give the embedding matrix.

    The logits are this projection followed by `logit_transform(model)`. A PEFT `ModulesToSaveWrapper` around the
    head (`modules_to_save=["lm_head"]`) gives the copy its forward would run (`saved_module_in_use`). Raises
    ValueError when the output embeddings are not an nn.Linear.
    """
    head = saved_module_in_use(model.get_output_embeddings())
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__}'s output embeddings are {type(head).__name__}, not an nn.Linear")
    return head.weight, head.bias


def saved_module_in_use(module: nn.Module) -> nn.Module:
    """The module a PEFT `ModulesToSaveWrapper` would run now: the active adapter's trained copy, or the frozen
    original while adapters are disabled (a reference pass) or the active adapter has no copy; any other module
    as it is. Reading the copy (not the wrapper's forwarded attributes) sends the gradient to the trained weight."""
    peft_utils = sys.modules.get("peft.utils.other")  # no PEFT imported: no wrapper can exist
    if peft_utils is None or not isinstance(module, peft_utils.ModulesToSaveWrapper):
        return module
    active = module.active_adapters
    if module.disable_adapters or not active or any(name not in module.modules_to_save for name in active):
        return module.original_module
    return module.modules_to_save[active[0]]


def completion_hidden_states(
    model: nn.Module,
    input_ids: Tensor | PackedSequences,
    attention_mask: Tensor | None = None,
    num_completion: int | None = None,
) -> Tensor:
    """Final hidden states at the positions that predict the completion tokens: [B, T, H] for the last
    `num_completion` columns of a padded batch, [N, H] for a `PackedSequences` (then no mask, no count)."""
    decoder = model.get_decoder()
    if isinstance(input_ids, PackedSequences):
        if attention_mask is not None or num_completion is not None:
            raise ValueError("a PackedSequences input takes no attention_mask or num_completion: it holds them")
        packed = input_ids
        hidden = decoder(
            input_ids=packed.input_ids[None],
            position_ids=packed.position_ids[None],
            use_cache=False,
            **varlen_kwargs(model, packed.cu_seqlens, packed.max_length),
        ).last_hidden_state[0]  # [N_in, H]
        return hidden[packed.completion_index - 1]  # [N, H]: position p predicts token p + 1
    if attention_mask is None or num_completion is None:
        raise ValueError("a padded input_ids [B, P + T] needs its attention_mask and num_completion")
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, -num_completion - 1 : -1]  # position p predicts token p + 1


def policy_logprobs(
    model: nn.Module,
    input_ids: Tensor | PackedSequences,
    attention_mask: Tensor | None = None,
    completion_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stats: tuple[str, ...] = (),
    chunk_size: int | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor] | dict[str, Tensor]:
    """log π(completion token) (and entropy) for a causal LM, through the fused lm_head with the model's logit
    transform (`logit_transform`): no logits over the vocabulary are stored. Padded: [B, T], 0 where
    `completion_mask` is 0. Packed (`input_ids` a `PackedSequences`, no masks): [N], one per completion token.
    Differentiable w.r.t. the model's parameters. `top_k`, `top_p`, `min_p` (sampling replay) and `stats` (a dict
    result) as in `fused_linear_token_logprobs`."""
    weight, bias = lm_head(model)
    logit_scale, softcap = logit_transform(model)
    if isinstance(input_ids, PackedSequences):
        if attention_mask is not None or completion_mask is not None:
            raise ValueError("a PackedSequences input takes no attention_mask or completion_mask: it holds them")
        hidden, targets = completion_hidden_states(model, input_ids), input_ids.targets  # [N, H], [N]
    else:
        if attention_mask is None or completion_mask is None:
            raise ValueError("a padded input_ids [B, P + T] needs its attention_mask and completion_mask")
        num_completion = completion_mask.shape[1]
        if input_ids.shape[1] <= num_completion:
            raise ValueError(
                f"input_ids must hold a prompt before the {num_completion} completion tokens, "
                f"got {list(input_ids.shape)}"
            )
        hidden = completion_hidden_states(model, input_ids, attention_mask, num_completion)  # [B, T, H]
        targets = input_ids[:, -num_completion:]  # [B, T]
    return fused_linear_token_logprobs(
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        logit_scale=logit_scale,
        final_logit_softcapping=softcap,
        with_entropy=with_entropy,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stats=stats,
        mask=completion_mask,
        chunk_size=chunk_size,
        backend=backend,
    )

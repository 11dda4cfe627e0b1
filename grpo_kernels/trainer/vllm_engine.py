"""Building a colocated `vllm.LLM` that lives on this rank's GPU, is sized for the step's batch and leaves the trainer's
random state alone; and the two ways of pushing the policy's weights into it.

Each behaviour here depends on vLLM's; the files named are those of vLLM 0.33.0 (read from its wheel) and of TRL 1.16,
which drives vLLM the same way (`trl/generation/vllm_generation.py`, colocate mode).
- Device. Without `distributed_executor_backend` a one-GPU engine gets the "uni" executor, whose local rank comes from
  the bare device string "cuda", i.e. 0 (`vllm/v1/executor/uniproc_executor.py`, `UniProcExecutor._distributed_args`),
  and its worker then makes cuda:0 the process's device (`vllm/v1/worker/gpu_worker.py`, `init_device`). The
  "external_launcher" executor (`ExecutorWithExternalLauncher`, same file) reads RANK and LOCAL_RANK from the
  environment and joins the torch.distributed group through env:// (MASTER_ADDR / MASTER_PORT) when the trainer has
  not: `rank_environment` sets them as TRL does. It needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (asserted there), which
  also keeps the engine core in this process (`vllm/v1/engine/llm_engine.py`). Every rank must build its engine at
  the same time: building creates process groups and takes the minimum free memory over ranks.
- Random state. The worker calls `set_random_seed(seed)` (python `random`, numpy, torch, every CUDA device:
  `vllm/utils/torch_utils.py`) in `init_device` and again after warm-up; `preserved_rng_state` puts the trainer's back.
- Memory. `gpu_memory_utilization` is a share of the *total* memory, and start-up fails when less than that is free
  (`vllm/v1/worker/utils.py`, `request_memory`); `check_gpu_memory` says so first, with what to lower.
- Sizes. `max_model_len` defaults to the model's context, `max_num_batched_tokens` / `max_num_seqs` to 16,384 / 1,024
  on an H100 (`vllm/engine/arg_utils.py`, `get_batch_defaults`), which inflates the profiling run; TRL pins 4,096
  tokens and sizes `max_num_seqs` from its batch. vLLM needs `max_num_batched_tokens >= max_num_seqs`
  (`vllm/config/scheduler.py`, `verify_max_model_len`); chunked prefill (on by default) lets it be below
  `max_model_len`.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAX_BATCHED_TOKENS = 4096  # TRL's value: keeps vLLM's profiling run small
OFFICIAL = "vLLM weight-update API (start_weight_update / update_weights / finish_weight_update)"
IN_PROCESS = "in-process load_weights (vLLM's 'v0 compatibility' model_executor path)"
IN_PROCESS_BACKEND = "grpo_kernels_in_process"  # our weight-transfer backend name in vLLM's registry


@dataclass(frozen=True)
class EngineSizes:
    """What the engine is sized for: the longest sequence and the rows of one `generate` call on this rank."""

    max_model_len: int  # longest prompt + max_completion_length
    max_num_seqs: int  # rows of one generate call: this rank's prompts × G
    max_num_batched_tokens: int  # tokens per scheduler step


def engine_sizes(max_prompt_tokens: int, max_completion_length: int, rows_per_call: int) -> EngineSizes:
    """Sizes for prompts of at most `max_prompt_tokens` tokens, `max_completion_length` new tokens, `rows_per_call`."""
    if min(max_prompt_tokens, max_completion_length, rows_per_call) < 1:
        raise ValueError(
            f"max_prompt_tokens, max_completion_length and rows_per_call must be >= 1, "
            f"got {max_prompt_tokens}, {max_completion_length}, {rows_per_call}"
        )
    max_model_len = max_prompt_tokens + max_completion_length
    batched = max(rows_per_call, min(MAX_BATCHED_TOKENS, rows_per_call * max_model_len))
    return EngineSizes(max_model_len, rows_per_call, batched)


def rank_environment(rank: int, world_size: int, device: torch.device) -> dict[str, str]:
    """The environment variables "external_launcher" reads, for this rank's engine on `device` (cuda:N: LOCAL_RANK is
    N, so the engine lands on the trainer's own GPU). MASTER_ADDR / MASTER_PORT are kept when set (torchrun sets
    them; vLLM only uses them when no process group exists yet), else localhost and a free port."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"--rollout vllm needs the trainer on a CUDA device cuda:N, got {str(device)!r}")
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(device.index),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or "localhost",
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Python `random`, numpy, torch CPU and every CUDA device's generator as they were before the block."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def gpu_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`, after returning torch's cached blocks (as vLLM does before measuring)."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def check_gpu_memory(device: torch.device, utilization: float, trainer: str) -> None:
    """A ValueError, before vLLM's own, when `utilization` of the total memory of `device` is more than is free."""
    free, total = gpu_memory(device)
    wanted = math.ceil(total * utilization)
    if free < wanted:
        gib = 2.0**30
        raise ValueError(
            f"vllm_gpu_memory_utilization={utilization} asks vLLM for {wanted / gib:.2f} GiB of the {total / gib:.2f} "
            f"GiB of {device}, but only {free / gib:.2f} GiB are free with {trainer} on it: lower "
            f"--vllm-gpu-memory-utilization to at most {math.floor(free / total * 100) / 100:.2f}, or lower "
            f"--dtype / --ref-model-dtype (e.g. bfloat16) to free memory"
        )


def route_vllm_log(log_file: str | os.PathLike | None) -> None:
    """vLLM's own log (its `vllm` logger, which vLLM gives a console handler at import: `vllm/logger.py`) into
    `log_file`, so that the trainer's progress is what the console shows; None: left on the console. A file of an
    earlier engine of this process is closed."""
    if log_file is None:
        return
    logger = logging.getLogger("vllm")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        if isinstance(handler, logging.FileHandler):
            handler.close()
    handler = logging.FileHandler(log_file, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def official_weight_api(vllm) -> bool:
    """Whether this vLLM has the RL weight-update API (`vllm/entrypoints/rl/offline.py`, `RLOfflineMixin`) and the
    weight-transfer engine registry it drives (`vllm/distributed/weight_transfer/`)."""
    methods = ("start_weight_update", "update_weights", "finish_weight_update")
    if not all(callable(getattr(vllm.LLM, m, None)) for m in methods):
        return False
    try:
        from vllm.distributed.weight_transfer import base, factory  # noqa: F401
        from vllm.model_executor.model_loader import reload  # noqa: F401
    except ImportError:
        return False
    return True


def register_in_process_backend() -> str:
    """Register (once per process) a weight-transfer engine that takes the policy's tensors themselves, and return its
    name for `LLM(weight_transfer_config={"backend": ...})`.

    vLLM's colocated backend is CUDA IPC between processes (`vllm/distributed/weight_transfer/ipc_engine.py`); with
    "external_launcher" the engine runs in the trainer's process, where `collective_rpc` calls the worker directly
    (`UniProcExecutor.collective_rpc`), so the tensors can be handed over as they are. Like the IPC engine, an update
    is a layerwise reload: `initialize_layerwise_reload` at the start, `load_weights` per chunk,
    `finalize_layerwise_reload` at the end (`vllm/model_executor/model_loader/reload/`).
    """
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class InProcessInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class InProcessUpdateInfo(WeightTransferUpdateInfo):
        weights: list[tuple[str, torch.Tensor]]

    class InProcessWeightTransferEngine(WeightTransferEngine[InProcessInitInfo, InProcessUpdateInfo]):
        init_info_cls = InProcessInitInfo
        update_info_cls = InProcessUpdateInfo

        def init_transfer_engine(self, init_info: InProcessInitInfo) -> None:
            """Nothing to connect: the weights come in-process."""

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: InProcessUpdateInfo) -> None:
            self.model.load_weights(update_info.weights)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            """Nothing to release."""

    try:
        WeightTransferEngineFactory.register_engine(IN_PROCESS_BACKEND, InProcessWeightTransferEngine)
    except ValueError as error:  # registered by an earlier engine of this process
        if "already registered" not in str(error):
            raise
    return IN_PROCESS_BACKEND


def push_weights(llm, weights: list[tuple[str, torch.Tensor]], official: bool) -> None:
    """Every (vLLM name, tensor) into the running model, through the official API or the in-process model."""
    if official:
        llm.start_weight_update()
        llm.update_weights({"update_info": {"weights": weights}})
        llm.finish_weight_update()
    else:  # TRL's colocate push (`_push_param_to_vllm`); model_executor exists with the in-process engine core
        llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)


def llm_kwargs(
    model_path: str,
    *,
    sizes: EngineSizes,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    seed: int,
    dtype: str,
    weight_backend: str | None,
    on_cpu: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` (`vllm/entrypoints/llm.py`, `EngineArgs`) for this rank's colocated sampler;
    `on_cpu`: vLLM's CPU engine, a world of one with the default ("uni") executor.

    The engine starts from random weights (`load_format="dummy"`, `vllm/model_executor/model_loader/dummy_loader.py`):
    only the first push makes it the policy, so a push that does not arrive shows at once in the sampler-sync guard
    (`sampler_sync.py`), and the checkpoint on disk is never read."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    kwargs = {
        "model": model_path,
        "load_format": "dummy",
        "seed": seed,  # per rank
        "dtype": dtype,
        "gpu_memory_utilization": gpu_memory_utilization,  # the rest of the GPU is the trainer's
        "max_model_len": sizes.max_model_len,
        "max_num_seqs": sizes.max_num_seqs,
        "max_num_batched_tokens": sizes.max_num_batched_tokens,
        "enable_sleep_mode": enable_sleep_mode,
        "logprobs_mode": "processed_logprobs",  # log-probs of the distribution sampled from (after temperature)
    }
    if on_cpu:
        kwargs["enforce_eager"] = True  # inductor's compile doubles the build, gains nothing measured (benchmarks.md)
    else:
        kwargs["distributed_executor_backend"] = "external_launcher"  # this rank's GPU, from LOCAL_RANK
    if weight_backend is not None:
        kwargs["weight_transfer_config"] = {"backend": weight_backend}
    return kwargs

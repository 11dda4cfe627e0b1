"""fused_linear_grpo_loss forward + backward against the eager loss on materialised logits and Liger's chunked
`LigerFusedLinearGRPOLoss` (when installed), B=8, T=256, H=896, V=151936 fp32 on CPU, 78% of the tokens valid.

Floor: the three lm_head GEMMs (2·N·V·H FLOPs each); memory floor: grad_W + grad_hidden. Peak memory on CPU is
measured per provider in a fresh process by `python -m benchmarks.measure_cpu_memory fused_linear`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.measure_cpu_memory import FUSED_SHAPE, _inputs, _step

PROVIDERS = ["grpo_kernels", "naive"] + (["liger"] if importlib.util.find_spec("liger_kernel") else [])


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_fused_linear_fwd_bwd(benchmark, provider):
    inputs = _inputs(**FUSED_SHAPE, keep=0.78)
    benchmark.extra_info.update(device="cpu", torch=torch.__version__, **FUSED_SHAPE, dtype="float32", valid=0.78)

    def step():
        for x in inputs[:2]:
            x.grad = None
        _step("fused_linear", provider, *inputs).backward()

    benchmark.pedantic(step, rounds=2, warmup_rounds=1)

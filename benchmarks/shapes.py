"""Benchmark shapes: small on CPU, real vocabularies on GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    V: int
    dtype: torch.dtype


CPU_SHAPES = (Shape("cpu_small", 4, 128, 32000, torch.float32),)
GPU_SHAPES = (
    Shape("gpu_qwen_8k", 16, 512, 151936, torch.bfloat16),
    Shape("gpu_llama3_8k", 16, 512, 128256, torch.bfloat16),
)


def shapes_for(device: torch.device) -> tuple[Shape, ...]:
    return GPU_SHAPES if device.type == "cuda" else CPU_SHAPES

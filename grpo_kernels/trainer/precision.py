"""The parameter dtypes of the policy, the reference model and the vLLM sampler (`TrainConfig.dtype`,
`ref_model_dtype`, `vllm_dtype`).

`auto` is bfloat16 on a GPU and float32 on the CPU for the policy, the policy's dtype for the reference, and the
policy's dtype for the sampler: a sampler in another precision than the trainer moves the importance ratio
π_old / π_sampler away from 1 by numerics alone. (vLLM's own `dtype="auto"` takes the checkpoint config's
`torch_dtype`, downcast to the platform's first supported dtype, bf16 or fp16, where that says fp32:
`vllm/config/model.py`, `_resolve_auto_dtype`, in vLLM 0.33.0.)
"""

from __future__ import annotations

import torch

from grpo_kernels.shown import shown

DTYPES = ("auto", "float32", "bfloat16", "float16")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def policy_dtype(name: str, device: torch.device) -> torch.dtype:
    """`TrainConfig.dtype` on `device`: auto is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _named(name, "dtype")


def follower_dtype(name: str, policy: torch.dtype, option: str) -> torch.dtype:
    """The reference's or the sampler's dtype: `auto` follows the policy's."""
    return policy if name == "auto" else _named(name, option)


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16: the spelling vLLM's `dtype` argument and the config take."""
    return str(dtype).removeprefix("torch.")


def _named(name: str, option: str) -> torch.dtype:
    if name not in _TORCH:
        raise ValueError(f"{option} must be one of {list(DTYPES)}, got {shown(name)}")
    return _TORCH[name]

"""Vocabulary pass in CUDA C++ (the extension grpo_kernels._C, built from csrc/): the protocol's token_logprobs_fwd /
token_logprobs_bwd and grpo_loss_fwd (over the records of `protocol.py`), each unpacking its records into the
arguments of one of torch.ops.grpo_kernels.*.

The extension is loaded on first use, never at import; without it `ops()` raises an error naming the build command.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from grpo_kernels.kernels.protocol import LossSides, RowGrads, VocabPassArgs, epilogue_fields, writes_in_place

BUILD_COMMAND = "GRPO_KERNELS_BUILD_CUDA=1 pip install --no-build-isolation ."


def ops():
    """torch.ops.grpo_kernels, after loading grpo_kernels._C (once; a failed load is retried on the next call)."""
    _load_extension()
    return torch.ops.grpo_kernels


@functools.cache
def _load_extension() -> None:
    try:
        importlib.import_module("grpo_kernels._C")
    except ImportError as error:
        raise RuntimeError(
            f"backend='cuda' needs the compiled extension grpo_kernels._C, which is not available ({error}); "
            f"build it on a machine with nvcc and a CUDA build of torch: `{BUILD_COMMAND}`, "
            "or use backend='triton' or 'torch'"
        ) from error


def cuda_usable(device: torch.device) -> tuple[bool, str]:
    """Whether the CUDA backend can run on `device`, and why not when it cannot (the extension is checked first)."""
    try:
        ops()
    except RuntimeError as error:
        return False, str(error)
    if device.type != "cuda":
        return False, f"backend='cuda' needs CUDA tensors, got {device.type} tensors"
    return True, ""


def _f32(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.to(torch.float32).contiguous()


def _ids_and_mask(args: VocabPassArgs) -> tuple[Tensor, Tensor]:
    return args.targets.to(torch.int64).contiguous(), args.mask.to(torch.bool).contiguous()


def _transform(args: VocabPassArgs) -> tuple[float, float | None]:
    """(logit_scale, softcap) as the ops take them, after the temperature."""
    return float(args.logit_scale), None if args.softcap is None else float(args.softcap)


def token_logprobs_fwd(args: VocabPassArgs) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """logits (last stride 1) -> logp, lse, entropy|None, [B, T] fp32, and no statistics: asking for any
    (`args.stats`) is an error on this backend."""
    if args.stats:
        raise ValueError(f"backend='cuda' does not compute {list(args.stats)}; use backend='triton' or 'torch'")
    logp, lse, entropy = ops().token_logprobs_fwd(
        args.logits, *_ids_and_mask(args), float(args.temperature), bool(args.with_entropy), *_transform(args)
    )
    return logp, lse, (entropy if args.with_entropy else None), {}


def token_logprobs_bwd(args: VocabPassArgs, grads: RowGrads, out: Tensor) -> None:
    """Write dL/dlogits into `out` (may be the logits themselves; last strides 1); masked rows get 0. Into the
    logits, it is the op whose schema says it mutates them (`token_logprobs_bwd_inplace`, `Tensor(a!) logits`):
    under `torch.compile` the other one's would claim the logits unchanged."""
    rows = (*_ids_and_mask(args), _f32(grads.lse), _f32(grads.entropy), _f32(grads.grad_logp), _f32(grads.grad_entropy))
    if writes_in_place(out, args.logits):
        ops().token_logprobs_bwd_inplace(args.logits, *rows, float(args.temperature), *_transform(args))
    else:
        ops().token_logprobs_bwd(args.logits, *rows, float(args.temperature), *_transform(args), out)


def grpo_loss_fwd(
    args: VocabPassArgs, sides: LossSides, epilogue
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """One pass: logp, lse, entropy|None, weighted per-token loss, weighted dL/dlogp, each [B, T] float32.

    The sides' weights, old/ref [B, T]; advantages / is_ratio [B, T] float32 views (stride 0 in T for per-sequence
    values); `epilogue` a `TokenEpilogue` (the policy kind and its hyperparameters).
    """
    is_ratio = None if sides.is_ratio is None else sides.is_ratio.to(torch.float32)
    logp, lse, entropy, loss, dlogp = ops().grpo_loss_fwd(
        args.logits, *_ids_and_mask(args), _f32(sides.weights), sides.advantages.to(torch.float32),
        _f32(sides.old_logp), _f32(sides.ref_logp), is_ratio, *epilogue_fields(epilogue), float(args.temperature),
        bool(args.with_entropy), *_transform(args),
    )  # fmt: skip
    return logp, lse, (entropy if args.with_entropy else None), loss, dlogp

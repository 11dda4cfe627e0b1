"""Vocabulary pass in CUDA C++ (the extension grpo_kernels._C, built from csrc/): launchers with the signatures of
triton/token_logprobs.py's token_logprobs_fwd / token_logprobs_bwd and triton/grpo_loss.py's grpo_loss_fwd, calling
torch.ops.grpo_kernels.*.

The extension is loaded on first use, never at import; without it `ops()` raises an error naming the build command.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from grpo_kernels.kernels.protocol import writes_in_place

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


def _ids_and_mask(targets: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return targets.to(torch.int64).contiguous(), mask.to(torch.bool).contiguous()


def _softcap(softcap: float | None) -> float | None:
    return None if softcap is None else float(softcap)


def token_logprobs_fwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    stats: tuple[str, ...] = (),
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """logits [B, T, V] (last stride 1), targets [B, T], mask [B, T] bool -> logp, lse, entropy|None, [B, T] fp32,
    and no statistics: asking for any (`stats`) is an error on this backend."""
    if stats:
        raise ValueError(f"backend='cuda' does not compute {list(stats)}; use backend='triton' or 'torch'")
    targets, mask = _ids_and_mask(targets, mask)
    logp, lse, entropy = ops().token_logprobs_fwd(
        logits, targets, mask, float(temperature), bool(with_entropy), float(logit_scale), _softcap(softcap)
    )
    return logp, lse, (entropy if with_entropy else None), {}


def token_logprobs_bwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    out: Tensor,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> None:
    """Write dL/dlogits into `out` (may be `logits` itself; last strides 1); masked rows get 0. Into the logits, it
    is the op whose schema says it mutates them (`token_logprobs_bwd_inplace`, `Tensor(a!) logits`): under
    `torch.compile` the other one's would claim the logits unchanged."""
    targets, mask = _ids_and_mask(targets, mask)
    args = (targets, mask, _f32(lse), _f32(entropy), _f32(grad_logp), _f32(grad_entropy), float(temperature))
    transform = (float(logit_scale), _softcap(softcap))
    if writes_in_place(out, logits):
        ops().token_logprobs_bwd_inplace(logits, *args, *transform)
    else:
        ops().token_logprobs_bwd(logits, *args, *transform, out)


def grpo_loss_fwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    weights: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    epilogue,
    temperature: float,
    with_entropy: bool,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """One pass: logp, lse, entropy|None, weighted per-token loss, weighted dL/dlogp, each [B, T] float32.

    weights, old/ref [B, T]; advantages / is_ratio [B, T] float32 views (stride 0 in T for per-sequence values);
    `epilogue` a `TokenEpilogue` (the policy kind and its hyperparameters).
    """
    targets, mask = _ids_and_mask(targets, mask)
    logp, lse, entropy, loss, dlogp = ops().grpo_loss_fwd(
        logits,
        targets,
        mask,
        _f32(weights),
        advantages.to(torch.float32),
        _f32(old_logp),
        _f32(ref_logp),
        None if is_ratio is None else is_ratio.to(torch.float32),
        epilogue.kind,
        float(epilogue.eps_low),
        float(epilogue.eps_high),
        None if epilogue.delta is None else float(epilogue.delta),
        None if epilogue.clip_ratio_c is None else float(epilogue.clip_ratio_c),
        bool(epilogue.cispo_two_sided),
        float(epilogue.beta),
        epilogue.kl_estimator,
        bool(epilogue.bias_correction),
        float(epilogue.tau_pos),
        float(epilogue.tau_neg),
        float(temperature),
        bool(with_entropy),
        float(logit_scale),
        _softcap(softcap),
    )
    return logp, lse, (entropy if with_entropy else None), loss, dlogp

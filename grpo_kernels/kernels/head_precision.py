"""`head_precision`: the precision of the fused lm_head's logits GEMM, the one GEMM whose rounding the log-probs see.

- "auto": the weight's dtype (a bf16 head rounds every logit to bf16 before the softmax).
- "bf16": hidden states and weight cast to bf16; bf16 logits.
- "fp32": hidden states and weight upcast to float32, an IEEE float32 GEMM, float32 logits.
- "tf32": as "fp32", with TF32 tensor cores allowed on CUDA (bf16 and fp16 operands are exact in TF32's 10-bit
  mantissa, so for them only the accumulation order differs from "fp32"); elsewhere it is "fp32".

The backward GEMMs (dH, dW) always run in the weight's dtype with float32 accumulation: dL/dlogits is cast to the
weight's dtype first. So "fp32" on a bf16 head removes the bf16 rounding of the logits (the trainer–sampler log-prob
gap) without float32 gradient GEMMs. The weight is upcast once per pass on the row-chunk routes ([V, H] float32,
freed after the pass), one vocabulary tile at a time on the lean route.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

HEAD_PRECISIONS = ("auto", "bf16", "tf32", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "tf32": torch.float32, "fp32": torch.float32}


def check_head_precision(head_precision: str) -> None:
    if head_precision not in HEAD_PRECISIONS:
        raise ValueError(f"head_precision must be one of {HEAD_PRECISIONS}, got {head_precision!r}")


def logits_dtype(head_precision: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits GEMM's operands and output."""
    return _DTYPES.get(head_precision, weight_dtype)


def cast(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """x in `dtype` (x itself when it is already)."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


@contextlib.contextmanager
def gemm_precision(head_precision: str, device: torch.device):
    """Inside: CUDA float32 GEMMs as `head_precision` asks (TF32 for "tf32", IEEE for "fp32"); else unchanged."""
    if device.type != "cuda" or head_precision not in ("tf32", "fp32"):
        yield
        return
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if head_precision == "tf32" else "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = saved


def operands(weight: Tensor, bias: Tensor | None, head_precision: str) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) in the logits GEMM's dtype: the parameters themselves for "auto", else copies for the pass."""
    dtype = logits_dtype(head_precision, weight.dtype)
    return cast(weight, dtype), cast(bias, dtype)


def logits_gemm(hidden: Tensor, weight: Tensor, bias: Tensor | None, *, out: Tensor, head_precision: str) -> Tensor:
    """out [c, w] = hidden [c, H] @ weight [w, H].T (+ bias [w]): hidden cast to out's dtype, the one `operands`
    gave weight and bias; CUDA float32 GEMM flags as `head_precision` says."""
    hidden = cast(hidden, out.dtype)
    with gemm_precision(head_precision, out.device):
        if bias is None:
            return torch.mm(hidden, weight.T, out=out)
        return torch.addmm(bias, hidden, weight.T, out=out)

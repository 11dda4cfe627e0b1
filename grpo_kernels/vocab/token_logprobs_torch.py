"""Vocabulary pass in chunked PyTorch: the CPU path, and the reference layout of the Triton kernels.

Only the rows the mask keeps are read, a chunk of rows at a time, so no [N, V] float32 tensor ever exists.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 22  # logits per chunk: 16 MiB of float32 scratch at most


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 input, float64 for float64 input."""
    return torch.promote_types(dtype, torch.float32)


def _row_chunks(mask: Tensor, vocab: int):
    """Yield (b, t) index pairs of kept rows, a chunk at a time."""
    b_idx, t_idx = mask.nonzero(as_tuple=True)
    step = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, b_idx.numel(), step):
        yield b_idx[start : start + step], t_idx[start : start + step]


def _scaled_rows(logits: Tensor, b: Tensor, t: Tensor, temperature: float) -> Tensor:
    """The kept rows' logits / temperature in the compute dtype: one fresh [C, V] buffer, scaled in place."""
    z = logits[b, t].to(compute_dtype(logits.dtype))  # [C, V]
    return z.div_(temperature) if temperature != 1.0 else z


def token_logprobs_fwd(
    logits: Tensor, targets: Tensor, mask: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """logits [B, T, V], targets [B, T], mask [B, T] bool -> logp, lse, entropy (or None), each [B, T].

    Masked rows get 0.
    """
    dtype = compute_dtype(logits.dtype)
    logp = torch.zeros(mask.shape, dtype=dtype, device=logits.device)  # [B, T]
    lse = torch.zeros_like(logp)  # [B, T]
    entropy = torch.zeros_like(logp) if with_entropy else None  # [B, T]
    for b, t in _row_chunks(mask, logits.shape[-1]):
        z = _scaled_rows(logits, b, t, temperature)  # [C, V]
        row_lse = torch.logsumexp(z, dim=-1)  # [C]
        lse[b, t] = row_lse
        logp[b, t] = z.gather(1, targets[b, t, None]).squeeze(1) - row_lse
        if entropy is not None:  # H = −Σ q log q, with 0 · log 0 = 0 for -inf logits
            entropy[b, t] = torch.special.entr(z.sub_(row_lse[:, None]).exp_()).sum(-1)
    return logp, lse, entropy


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
) -> None:
    """Write dL/dlogits into `out` (which may be `logits` itself): per kept row

    g·(onehot − q)/T  +  g_H·(−q·(log q + H))/T,  q = softmax(logits/T);  masked rows get 0.
    """
    for b, t in _row_chunks(mask, logits.shape[-1]):
        log_q = _scaled_rows(logits, b, t, temperature).sub_(lse[b, t, None])  # [C, V]
        g = torch.zeros_like(lse[b, t]) if grad_logp is None else grad_logp[b, t].to(log_q.dtype)  # [C]
        if grad_entropy is None:
            grad = log_q.exp_().mul_(-g[:, None])  # [C, V], reusing the buffer
        else:
            q = log_q.exp()  # [C, V]
            shifted = torch.where(q > 0, log_q.add_(entropy[b, t, None]), 0.0)  # log q + H, 0 where q = 0
            grad = shifted.mul_(q).mul_(-grad_entropy[b, t, None].to(q.dtype)).sub_(q.mul_(g[:, None]))
        grad.scatter_add_(1, targets[b, t, None], g[:, None])
        out[b, t] = (grad.div_(temperature) if temperature != 1.0 else grad).to(out.dtype)
    out[~mask] = 0

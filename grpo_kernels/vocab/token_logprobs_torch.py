"""Vocabulary pass in chunked PyTorch: the CPU path, and the reference layout of the Triton kernels.

Only the rows the mask keeps are read, a chunk of rows at a time, so no [N, V] float32 tensor ever exists.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 22  # logits per chunk: 16 MiB of float32 scratch at most
LSE_FROM_TARGET = 32.0  # lse = z_t − log q_t for log q_t > −32 (rounding ≤ ulp(32)); logsumexp for the rest


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 input, float64 for float64 input."""
    return torch.promote_types(dtype, torch.float32)


def _row_chunks(logits: Tensor, mask: Tensor):
    """Yield (index, rows) per chunk of kept rows: `index` selects them in [B, T] (a flat slice, or (b, t)
    index tensors), `rows` [C, V] are their logits: a view when every row is kept and the layout allows it,
    else a gathered copy."""
    vocab = logits.shape[-1]
    step = max(1, CHUNK_ELEMENTS // vocab)
    if logits.is_contiguous() and bool(mask.all()):
        flat = logits.view(-1, vocab)  # [B·T, V]
        for start in range(0, flat.shape[0], step):
            yield slice(start, start + step), flat[start : start + step]
        return
    b_idx, t_idx = mask.nonzero(as_tuple=True)
    for start in range(0, b_idx.numel(), step):
        b, t = b_idx[start : start + step], t_idx[start : start + step]
        yield (b, t), logits[b, t]


def _at(x: Tensor, index) -> Tensor:
    """x [B, T, ...] at a chunk's index: a view for a flat slice, gathered for (b, t)."""
    return x.flatten(0, 1)[index] if isinstance(index, slice) else x[index]


def _put(x: Tensor, index, values: Tensor) -> None:
    """x [B, T, ...] at a chunk's index = values."""
    if isinstance(index, slice):
        x.flatten(0, 1)[index] = values
    else:
        x[index] = values


def _scaled(rows: Tensor, temperature: float) -> Tensor:
    """rows / temperature in the compute dtype, never modifying `rows` (a view of the caller's logits)."""
    z = rows.to(compute_dtype(rows.dtype))
    return z / temperature if temperature != 1.0 else z


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
    for index, rows in _row_chunks(logits, mask):
        z = _scaled(rows, temperature)  # [C, V]
        target = _at(targets, index)[:, None]  # [C, 1]
        log_q = torch.log_softmax(z, dim=-1)  # [C, V]: one fused pass, several times faster than logsumexp on CPU
        row_logp = log_q.gather(1, target).squeeze(1)  # [C]
        row_lse = z.gather(1, target).squeeze(1) - row_logp  # [C]: lse = z_target − log q_target, as exact as
        unlikely = ~(row_logp > -LSE_FROM_TARGET)  # lse itself while log q_target is small: recompute the others
        if bool(unlikely.any()):
            row_lse[unlikely] = torch.logsumexp(z[unlikely], dim=-1)
        _put(lse, index, row_lse)
        _put(logp, index, row_logp)
        if entropy is not None:  # H = −Σ q log q, with 0 · log 0 = 0 for -inf logits (the NaN of 0 · −inf)
            _put(entropy, index, -log_q.exp().mul_(log_q).nan_to_num_(nan=0.0).sum(-1))
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
    When `out` is the logits in float32 (or float64) and every row is kept, each chunk is rewritten in place.
    """
    dtype = compute_dtype(logits.dtype)
    in_place = out is logits and logits.dtype == dtype
    for index, rows in _row_chunks(logits, mask):
        own = in_place and isinstance(index, slice)  # rows is a view of `out`: compute in it
        log_q = rows if own else rows.to(dtype, copy=True)  # [C, V]
        if temperature != 1.0:
            log_q.div_(temperature)
        log_q.sub_(_at(lse, index)[:, None])
        g = torch.zeros_like(_at(lse, index)) if grad_logp is None else _at(grad_logp, index).to(dtype)  # [C]
        if grad_entropy is None:
            grad = log_q.exp_().mul_(-g[:, None])  # [C, V], in the same buffer
        else:
            q = log_q.exp()  # [C, V]
            log_q.add_(_at(entropy, index)[:, None]).mul_(q).masked_fill_(q == 0, 0.0)  # q·(log q + H)
            grad = log_q.mul_(-_at(grad_entropy, index).to(dtype)[:, None]).sub_(q.mul_(g[:, None]))
        grad.scatter_add_(1, _at(targets, index)[:, None], g[:, None])
        if temperature != 1.0:
            grad.div_(temperature)
        if not own:
            _put(out, index, grad.to(out.dtype))
    out[~mask] = 0

"""The top-k-plus-tail divergence on one chunk of rows: each head's full-vocabulary log-probs gathered at the teacher's
k ids, plus one tail bucket holding the rest of its mass, then `divergence_chunk` on those k + 1 outcomes.

Gradient in z_s: with y = the student's k + 1 log-probs and g = dD/dy as the small pass gives it (Σ_j g_j = 0 there),
dD/dz_v = g_i at the i-th id, and g_tail·p_v / P_tail elsewhere (P_tail = exp(y_tail)); then times dz/dx.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.kernels.torch.divergence import (
    ChunkSpec,
    divergence_chunk,
    entropy_of,
    has_neg_inf,
    log_softmax_,
    logsumexp,
    transform_,
    zs_derivative,
)


def _with_tail(log_p: Tensor, ids: Tensor, block: int) -> Tensor:
    """`[c, k + 1]`: log p at the ids, then the log of the mass outside them (log_p is restored afterwards)."""
    kept = log_p.gather(1, ids)  # [c, k]
    log_p.scatter_(1, ids, float("-inf"))
    tail = logsumexp(log_p, block)  # [c, 1]
    log_p.scatter_(1, ids, kept)
    return torch.cat([kept, tail], 1)


def topk_divergence_chunk(
    zs: Tensor, zt: Tensor, targets: Tensor | None, spec: ChunkSpec, *, k: int, ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """`divergence_chunk`'s outputs for the top-k-plus-tail divergence, then the ids `[c, k]`: `ids` given, or the
    teacher's k largest logits."""
    student, temperature, block, with_grad = spec.student, spec.temperature, spec.block, spec.with_grad
    transform_(zs, student, temperature)
    transform_(zt, spec.teacher, temperature)
    lse_s, lse_t = log_softmax_(zs), log_softmax_(zt)
    if ids is None:
        ids = zt.topk(k, -1).indices  # [c, k]
    logp = None if targets is None else zs.gather(1, targets[:, None])[:, 0]
    entropy = entropy_of(zs, block, exact=not has_neg_inf(zs))
    ys, yt = _with_tail(zs, ids, block), _with_tail(zt, ids, block)  # [c, k + 1] each
    kept_s, tail_s = ys[:, :-1].clone(), ys[:, -1:].clone()
    outcomes = ChunkSpec(spec.beta, with_grad=with_grad, block=block)  # the k + 1 log-probs: no transform
    divergence, *_ = divergence_chunk(ys, yt, None, outcomes)
    if with_grad:  # ys now holds dD/dy
        scale = torch.where(torch.isfinite(tail_s), ys[:, -1:], torch.zeros_like(tail_s))  # [c, 1]
        tail_s = torch.where(torch.isfinite(tail_s), tail_s, torch.zeros_like(tail_s))
        at_ids = ys[:, :-1] * zs_derivative(kept_s, lse_s, student, temperature)  # [c, k]
        for start in range(0, zs.shape[1], block):
            ls = zs[:, start : start + block]
            derivative = zs_derivative(ls.clone(), lse_s, student, temperature)
            ls.sub_(tail_s).exp_().mul_(scale).mul_(derivative)
        zs.scatter_(1, ids, at_ids)
    return divergence, entropy, logp, lse_s[:, 0], lse_t[:, 0], ids

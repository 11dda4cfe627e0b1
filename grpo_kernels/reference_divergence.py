"""Float64 oracle of the two-head distillation divergences, written formula by formula with full `[N, V]` logits.

Like `reference.py` it imports only torch and the standard library, never the code under test. The semantics are
TRL 1.16's `DistillationTrainer` (`_chunked_divergence_loss`): each head's logits are z = c·tanh(s·x/c) (scale s,
softcap c, per head), then divided by the one distillation temperature T; with p_s = softmax(z_s), p_t = softmax(z_t)
and `beta`:
- beta = 0: forward KL(p_t || p_s) = Σ_v p_t (log p_t − log p_s);
- beta = 1: reverse KL(p_s || p_t) = Σ_v p_s (log p_s − log p_t);
- else: generalized JSD = beta·KL(p_t || m) + (1 − beta)·KL(p_s || m), m = (1 − beta)·p_s + beta·p_t.
A term whose weight is 0 is 0 (0·log 0 = 0), so `-inf` logits in both heads are allowed; a token the weight's side
reaches and the other head excludes gives +inf. The loss is Σ over kept tokens / `num_items_in_batch` (None: the
kept-token count, at least 1). The student's entropy and the log-prob of the sampled token carry no gradient.

The top-k variant (`topk_divergence`) compares the two heads over the teacher's k ids plus one tail bucket holding
the rest of each head's mass, both distributions normalised over the whole vocabulary first.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

F64 = torch.float64


def head_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """float64 z = c·tanh(s·(hidden @ weight.T + bias)/c) / temperature, `[..., V]` (TRL's order)."""
    x = hidden.double() @ weight.double().T  # [..., V]
    if bias is not None:
        x = x + bias.double()
    x = x * logit_scale
    if final_logit_softcapping is not None:
        x = final_logit_softcapping * torch.tanh(x / final_logit_softcapping)
    return x / temperature  # [..., V]


def _weighted_log(weight: Tensor, log_ratio: Tensor) -> Tensor:
    """weight · log_ratio elementwise, 0 where the weight is 0 (whatever the log ratio; no NaN in the gradient)."""
    return weight * torch.where(weight > 0, log_ratio, torch.zeros_like(log_ratio))


def divergence_of_logprobs(log_ps: Tensor, log_pt: Tensor, beta: float) -> Tensor:
    """The per-row divergence `[...]` between two log-distributions `[..., K]` (see the module docstring)."""
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        return _weighted_log(pt, log_pt - log_ps).sum(-1)
    if beta == 1.0:
        return _weighted_log(ps, log_ps - log_pt).sum(-1)
    a, b = log_ps + math.log(1 - beta), log_pt + math.log(beta)  # [..., K]
    dead = torch.isneginf(a) & torch.isneginf(b)  # m = 0: kept out of logaddexp, whose gradient there is NaN
    log_m = torch.logaddexp(a.masked_fill(dead, 0.0), b.masked_fill(dead, 0.0)).masked_fill(dead, -math.inf)
    kl_teacher = _weighted_log(pt, log_pt - log_m).sum(-1)
    kl_student = _weighted_log(ps, log_ps - log_m).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def token_divergence(
    student_logits: Tensor, teacher_logits: Tensor, beta: float, targets: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(divergence, student entropy, student log-prob of `targets` or None), float64 `[...]`, from the transformed
    logits `[..., V]` (`head_logits`). Differentiable in the student logits through the divergence only."""
    log_ps = torch.log_softmax(student_logits.double(), -1)  # [..., V]
    log_pt = torch.log_softmax(teacher_logits.double(), -1).detach()  # [..., V]
    divergence = divergence_of_logprobs(log_ps, log_pt, beta)
    entropy = -_weighted_log(log_ps.exp(), log_ps).sum(-1).detach()
    logp = None if targets is None else log_ps.gather(-1, targets.long()[..., None])[..., 0].detach()
    return divergence, entropy, logp


def topk_logprobs(log_p: Tensor, ids: Tensor) -> Tensor:
    """log p over the ids `[..., k]` and a tail bucket, `[..., k + 1]`: log p_v for each id, then log of the mass
    outside them (-inf when they hold it all)."""
    kept = log_p.gather(-1, ids)  # [..., k]
    outside = log_p.scatter(-1, ids, -math.inf)  # [..., V]
    return torch.cat([kept, torch.logsumexp(outside, -1, keepdim=True)], -1)  # [..., k + 1]


def topk_divergence(
    student_logits: Tensor, teacher_logits: Tensor, beta: float, k: int, ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(divergence `[...]`, ids `[..., k]`) over the teacher's top-k ids plus the tail bucket: `ids` given, or the
    teacher's k largest logits (ties: torch.topk's pick)."""
    log_ps = torch.log_softmax(student_logits.double(), -1)  # [..., V]
    log_pt = torch.log_softmax(teacher_logits.double(), -1).detach()  # [..., V]
    if ids is None:
        ids = log_pt.topk(k, -1).indices  # [..., k]
    ids = ids.long()
    return divergence_of_logprobs(topk_logprobs(log_ps, ids), topk_logprobs(log_pt, ids), beta), ids


def reduce_divergence(kept_divergence: Tensor, num_items_in_batch: Tensor | float | None) -> Tensor:
    """TRL's rule on the kept tokens' divergence `[M]`: Σ / num_items_in_batch, or / M (at least 1) when it is None."""
    if num_items_in_batch is None:
        return kept_divergence.sum() / max(kept_divergence.numel(), 1)
    return kept_divergence.sum() / torch.as_tensor(num_items_in_batch, dtype=F64)


def fused_linear_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    num_items_in_batch: Tensor | float | None = None,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    top_k: int = 0,
    topk_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """{"loss", "divergence", "entropy", and "logp" with `targets`, "topk_ids" with top_k}, float64: the loss
    differentiable in the student's hidden, weight and bias (float64 autograd), per-token values `[...]` with 0 at
    dropped tokens. top_k > 0: the top-k-plus-tail divergence (`topk_ids` given, or the teacher's)."""
    kept = torch.ones(student_hidden.shape[:-1], dtype=torch.bool) if mask is None else mask.bool().cpu()
    rows = lambda x: None if x is None else x[kept.to(x.device)]  # noqa: E731  dropped tokens are never read
    zs = head_logits(rows(student_hidden), student_weight, student_bias, logit_scale=student_logit_scale,
                     final_logit_softcapping=student_final_logit_softcapping, temperature=temperature)  # fmt: skip
    zt = head_logits(rows(teacher_hidden), teacher_weight, teacher_bias, logit_scale=teacher_logit_scale,
                     final_logit_softcapping=teacher_final_logit_softcapping, temperature=temperature)  # fmt: skip
    divergence, entropy, logp = token_divergence(zs, zt, beta, rows(targets))
    out = {}
    if top_k:
        divergence, ids = topk_divergence(zs, zt, beta, top_k, rows(topk_ids))
        out["topk_ids"] = _scattered(ids, kept)
    out["loss"] = reduce_divergence(divergence, num_items_in_batch)
    out |= {"divergence": _scattered(divergence.detach(), kept), "entropy": _scattered(entropy, kept)}
    if logp is not None:
        out["logp"] = _scattered(logp, kept)
    return out


def _scattered(values: Tensor, kept: Tensor) -> Tensor:
    """Per-kept-token values `[M, ...]` at their places in `[*kept.shape, ...]`, 0 elsewhere."""
    out = values.new_zeros((*kept.shape, *values.shape[1:]))
    out[kept.to(values.device)] = values
    return out

"""The float64 oracle of sampling replay for the tests: the sampler's support (`reference.sampler_support`) of the
transformed logits, the log-probs and entropy renormalised over it, the log kept mass and the outside flags; and the
kept-set forms (vLLM's CSR `SamplingMask`, padded ids) of a support."""

from __future__ import annotations

import math

import torch

import grpo_kernels as gk
from grpo_kernels import reference
from tests.helpers import oracle_logits

RULES = {  # each rule alone, and all three (vLLM's order: min-p, top-k, top-p)
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.1},
    "all": {"top_k": 8, "top_p": 0.9, "min_p": 0.05},
}
STATS = ("log_kept_mass", "outside_support")


def support_of(logits: torch.Tensor, rule: dict, **transform) -> torch.Tensor:
    """The rule's support (bool [..., V]) of float64 copies of the logits, NaN (masked rows) read as 0."""
    z = reference.transformed_logits(oracle_logits(logits).detach(), **transform)
    return reference.sampler_support(z, **rule)


def oracle(logits: torch.Tensor, targets: torch.Tensor, support: torch.Tensor, **transform) -> dict:
    """{"x": the float64 leaf, "logp", "entropy", "log_kept_mass", "outside_support"} of the replayed pass; the
    caller backpropagates through logp / entropy into x.grad."""
    x = oracle_logits(logits)
    targets = targets.cpu()
    logp, entropy = reference.token_logprobs(x, targets, support=support, **transform)
    z = reference.transformed_logits(x.detach(), **transform)
    hot = torch.nn.functional.one_hot(targets.long(), z.shape[-1]).bool()
    log_kept = z.masked_fill(~(support | hot), -math.inf).logsumexp(-1) - z.logsumexp(-1)
    outside = ~support.gather(-1, targets.long()[..., None])[..., 0]
    return {"x": x, "logp": logp, "entropy": entropy, "log_kept_mass": log_kept, "outside_support": outside}


def csr(support: torch.Tensor) -> gk.SamplingMask:
    """vLLM's CSR form of a support [..., V]: positions in flattened order."""
    flat = support.reshape(-1, support.shape[-1])
    ids = flat.nonzero()[:, 1]
    offsets = torch.nn.functional.pad(flat.sum(-1).cumsum(0), (1, 0))
    return gk.SamplingMask(token_ids=ids, offsets=offsets)


def padded(support: torch.Tensor) -> torch.Tensor:
    """A support [..., V] as ids [..., K] with -1 padding (K its largest kept set)."""
    width = int(support.sum(-1).max())
    order = support.long().argsort(dim=-1, descending=True, stable=True)[..., :width]  # kept ids first
    kept = support.gather(-1, order)
    return order.masked_fill(~kept, -1)

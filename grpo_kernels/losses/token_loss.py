"""A token-level loss in the pieces the fused paths take: each token's weight ω (the normaliser's, times the token and
sequence weights: `token_omega`) and a chunk of kept rows' share of the loss with its gradients, by autograd through
the algebra (`autograd_share`). The closed form of the same share is the torch epilogue's
(`kernels/torch/grpo_loss.closed_form_share`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.loss import per_token_loss
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.losses.terms import build_terms
from grpo_kernels.options import LossOptions

ChunkShare = Callable[[slice, Tensor, Tensor | None], tuple[Tensor, Tensor | None, Tensor | None]]


def token_omega(
    mask: Tensor, token_weights: Tensor | None, sequence_weights: Tensor | None, options: LossOptions, dtype
) -> Tensor:
    """Each token's weight, [B, T] in `dtype`: the normaliser's ω of `mask` [B, T] times `token_weights` [B, T] and
    `sequence_weights` [B] (each None: 1)."""
    omega = token_weights_for(mask.to(dtype), POLICY_LOSSES[options.loss_type].normaliser, options)  # [B, T]
    if token_weights is not None:
        omega = omega * token_weights.to(dtype)  # [B, T]
    if sequence_weights is not None:
        omega = omega * sequence_weights.to(dtype)[:, None]  # [B, T]
    return omega


def autograd_share(
    omega: Tensor, side: dict[str, Tensor | None], row_mask: Tensor | None, options: LossOptions, num_kept: Tensor
) -> ChunkShare:
    """`(rows, logp, entropy) -> (the share of the loss, dL/dlogp, dL/dentropy)` of the kept rows `rows` [c] of
    `omega` and `side` (old_logp, ref_logp, advantages, is_ratio, [M] each or None); `row_mask` [M] drops padding
    rows (None: none). `num_kept`: the batch's kept-token count, a tensor (no host sync), the entropy bonus's
    denominator."""

    def loss_of(rows: slice, logp: Tensor, entropy: Tensor | None) -> Tensor:
        pick = lambda x: None if x is None else x[rows][None]  # noqa: E731  [1, c]
        terms = build_terms(
            logp[None],
            old_logp=pick(side["old_logp"]),
            ref_logp=pick(side["ref_logp"]),
            advantages=pick(side["advantages"]),
            mask=torch.ones_like(logp, dtype=torch.bool)[None] if row_mask is None else pick(row_mask),
            entropy=None if entropy is None else entropy[None],
            is_ratio=pick(side["is_ratio"]),
            options=options,
            token_weights=pick(omega),
        )
        loss = per_token_loss(terms, options).sum()
        if options.entropy_coef != 0.0:
            loss = loss - options.entropy_coef * entropy.sum() / num_kept
        return loss

    def share(rows: slice, logp: Tensor, entropy: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        with torch.enable_grad():  # on O(c) tensors
            logp = logp.detach().requires_grad_()
            entropy = None if entropy is None else entropy.detach().requires_grad_()
            leaves = [x for x in (logp, entropy) if x is not None]
            loss = loss_of(rows, logp, entropy)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return loss.detach(), grads[0], None if entropy is None else grads[1]

    return share

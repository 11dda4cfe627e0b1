"""Token-level losses formed inside the vocabulary pass: a token's loss depends on that token alone, so its weighted
loss and dL/dlogp are known as soon as its log-prob is (the Triton / CUDA epilogue on logits, the fused lm_head's
3-GEMM route). The PyTorch algebra of `losses/` stays the specification and gives the metrics."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.engine import layout as kept_rows
from grpo_kernels.engine.inputs import LossInputs
from grpo_kernels.kernels.function import TokenEpilogue, VocabPassOptions, fused_token_loss, poisoned
from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.loss import GRPOLossOutput, loss_metrics, per_token_loss
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.losses.terms import build_terms, per_sequence_or_token
from grpo_kernels.options import LossOptions

FUSED_KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")  # those the fused epilogues implement (Triton, CUDA)


def is_token_level(options: LossOptions, inputs: LossInputs) -> bool:
    """Whether a token's loss depends on that token alone (so it can be formed as soon as its log-prob is known)
    and no gradient flows into the weights."""
    weights = (inputs.token_weights, inputs.sequence_weights)
    return (
        POLICY_LOSSES[options.loss_type].epilogue is not None
        and options.importance_sampling_level == "token"
        and options.off_policy_mask_threshold is None  # a mean over the whole sequence
        and not any(w is not None and w.requires_grad for w in weights)
        and inputs.is_local()  # no statistics to merge across ranks first
    )


def token_omega(inputs: LossInputs, options: LossOptions) -> Tensor:
    """Each token's weight in the padded view: the normaliser's ω times any token / sequence weights, float32."""
    omega = token_weights_for(inputs.padded_mask().float(), POLICY_LOSSES[options.loss_type].normaliser, options)
    if inputs.token_weights is not None:
        omega = omega * inputs.padded(inputs.token_weights).float()  # [B, T]
    if inputs.sequence_weights is not None:
        omega = omega * inputs.sequence_weights.float()[:, None]  # [B, T]
    return omega


def fused_grpo_loss(
    rows: Tensor, inputs: LossInputs, opts: VocabPassOptions, options: LossOptions, invalid: Tensor | None
):
    """One kernel pass: each token's weighted loss and dL/dlogp come out of the forward kernel's epilogue."""
    epilogue = TokenEpilogue.from_options(POLICY_LOSSES[options.loss_type].epilogue, options)
    adv, is_w = per_sequence_or_token(inputs.advantages), per_sequence_or_token(inputs.is_ratio)  # [B, 1] or [B, T]
    loss, logp, entropy = fused_token_loss(
        rows,
        inputs.targets,
        inputs.mask,
        token_omega(inputs, options),
        adv,
        inputs.old_logp,
        inputs.ref_logp,
        is_w,
        opts,
        epilogue,
    )
    if invalid is not None:
        loss, logp = poisoned(loss, invalid), kept_rows.poison(logp, invalid)
    terms = build_terms(
        logp, inputs.old_logp, inputs.ref_logp, inputs.advantages, inputs.mask, entropy, inputs.is_ratio, options
    )  # for the metrics
    return GRPOLossOutput(loss, loss_metrics(terms, options))


def chunk_loss(inputs: LossInputs, kept: tuple[Tensor, Tensor], options: LossOptions, row_mask: Tensor | None):
    """A token-level loss as `(rows, logp, entropy) -> that chunk's share of the loss`, for the fused lm_head; the
    rows `row_mask` drops (None: none) are padding to it."""
    omega = inputs.from_padded(token_omega(inputs, options), kept)  # [M]
    side = {
        name: inputs.per_kept_token(getattr(inputs, name), kept)
        for name in ("old_logp", "ref_logp", "advantages", "is_ratio")
    }
    num_kept = inputs.mask.sum().clamp(min=1)  # a tensor: no host sync

    def share(rows: slice, logp: Tensor, entropy: Tensor | None) -> Tensor:
        pick = lambda x: None if x is None else x[rows][None]  # noqa: E731  [1, c]
        terms = build_terms(
            logp[None],
            pick(side["old_logp"]),
            pick(side["ref_logp"]),
            pick(side["advantages"]),
            torch.ones_like(logp, dtype=torch.bool)[None] if row_mask is None else pick(row_mask),
            None if entropy is None else entropy[None],
            pick(side["is_ratio"]),
            options,
            pick(omega),
        )
        loss = per_token_loss(terms, options).sum()
        if options.entropy_coef != 0.0:
            loss = loss - options.entropy_coef * entropy.sum() / num_kept
        return loss

    return share

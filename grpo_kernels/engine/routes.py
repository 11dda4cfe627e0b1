"""How a plan runs, one function per route (`plan.Route`); each ends with the layout undone (kept rows scattered
back, NaN at unchecked targets outside [0, V), [N] for [N, ·] inputs).

- `logprobs`: the vocabulary pass alone.
- `two_phase`: the pass, then the loss algebra of `losses/` on its log-probs (any loss, any option).
- `fused_epilogue`: logits in, a token-level loss's weighted loss and dL/dlogp come out of the forward kernel's
  epilogue (`losses/epilogue.py`); the algebra gives the metrics.
- `linear_token_loss`: the fused lm_head forms a token-level loss's gradients in its forward (3 GEMMs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from grpo_kernels.engine.layout import nan_at_invalid
from grpo_kernels.kernels import function, parallel, parallel_linear
from grpo_kernels.kernels.backend import CAPABILITIES
from grpo_kernels.kernels.fused_linear import ChunkLoss, fused_linear_logprobs, fused_linear_token_loss
from grpo_kernels.kernels.fused_linear_lean import lean_linear_logprobs
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.torch import grpo_loss as grpo_loss_torch
from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.epilogue import TokenEpilogue, fits_kernel_epilogue
from grpo_kernels.losses.loss import GRPOLossOutput, compute_loss, loss_metrics, per_token_loss
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.losses.terms import build_terms, per_sequence_or_token

if TYPE_CHECKING:
    from grpo_kernels.engine.inputs import LossInputs
    from grpo_kernels.engine.plan import Plan
    from grpo_kernels.options import LossOptions


def vocab_pass(plan: Plan) -> dict[str, Tensor]:
    """The plan's vocabulary pass: {"logp", "entropy" (when computed), each asked statistic}, [R, C] each (the fused
    lm_head's kept rows scattered back), logp NaN at unchecked targets outside [0, V)."""
    opts, kept, shard = plan.pass_options, plan.kept, plan.shard
    if kept is None:  # logits in
        if shard is None:
            out = function.vocab_pass(plan.rows, plan.targets, plan.mask, opts)
        else:
            out = parallel.vocab_pass(plan.rows, plan.targets, plan.mask, opts, shard=shard)
    else:  # the fused lm_head on the kept rows [M, H], scattered back to [R, C]
        rows = (kept.take(plan.rows), plan.source.weight, plan.source.bias, kept.take(plan.targets))
        if shard is None:  # row chunks ("fast") or 2-D tiles ("lean")
            linear = lean_linear_logprobs if opts.memory == "lean" else fused_linear_logprobs
            out = linear(*rows, opts=opts, row_mask=kept.row_mask)
        else:
            out = parallel_linear.fused_linear_logprobs(*rows, opts=opts, row_mask=kept.row_mask, shard=shard)
        out = {name: kept.scatter(x, plan.mask) for name, x in out.items()}
    out["logp"] = nan_at_invalid(out["logp"], plan.invalid)
    return out


def logprobs(plan: Plan):
    """token_logprobs / fused_linear_token_logprobs: logp, (logp, entropy) or the dict with the statistics."""
    out = vocab_pass(plan)
    out = {name: plan.layout.from_rows(x) for name, x in out.items()}
    if plan.pass_options.stats:
        return out
    return (out["logp"], out["entropy"]) if plan.pass_options.with_entropy else out["logp"]


def two_phase(plan: Plan):
    """The pass, then `compute_loss` on its log-probs; `(output, sequence_losses)` when asked."""
    out = vocab_pass(plan)
    terms = plan.inputs.terms(out["logp"], out.get("entropy"), plan.options)
    output, sequence_losses = compute_loss(terms, plan.options)
    return (output, sequence_losses) if plan.return_sequence_losses else output


def fused_epilogue(plan: Plan) -> GRPOLossOutput:
    """One kernel pass: each token's weighted loss and dL/dlogp come out of the forward kernel's epilogue."""
    inputs, options = plan.inputs, plan.options
    loss, logp, entropy = function.fused_token_loss(
        plan.rows,
        plan.targets,
        plan.mask,
        weights=token_omega(inputs, options, compute_dtype(plan.rows.dtype)),
        advantages=per_sequence_or_token(inputs.advantages),  # [B, 1] or [B, T]
        old_logp=inputs.old_logp,
        ref_logp=inputs.ref_logp,
        is_ratio=per_sequence_or_token(inputs.is_ratio),
        opts=plan.pass_options,
        epilogue=TokenEpilogue.from_options(options),
    )
    if plan.invalid is not None:
        loss, logp = function.poisoned(loss, plan.invalid), nan_at_invalid(logp, plan.invalid)
    terms = inputs.terms(logp, entropy, options)  # for the metrics
    return GRPOLossOutput(loss, loss_metrics(terms, options))


def linear_token_loss(plan: Plan) -> GRPOLossOutput:
    """The fused lm_head with a token-level loss's gradients formed in its forward (3 GEMMs)."""
    inputs, kept, options = plan.inputs, plan.kept, plan.options
    loss, logp, entropy = fused_linear_token_loss(
        kept.take(plan.rows),
        plan.source.weight,
        plan.source.bias,
        kept.take(plan.targets),
        opts=plan.pass_options,
        chunk_loss=chunk_loss(inputs, kept.index, options, kept.row_mask, compute_dtype(plan.rows.dtype)),
        row_mask=kept.row_mask,
    )
    logp = nan_at_invalid(kept.scatter(logp, plan.mask), plan.invalid)
    terms = inputs.terms(logp, kept.scatter(entropy, plan.mask), options)
    loss = loss if plan.invalid is None else function.poisoned(loss, plan.invalid)
    return GRPOLossOutput(loss, loss_metrics(terms, options))


def token_omega(inputs: LossInputs, options: LossOptions, dtype: torch.dtype) -> Tensor:
    """Each token's weight in the padded view: the normaliser's ω times any token / sequence weights, in `dtype`."""
    omega = token_weights_for(inputs.padded_mask().to(dtype), POLICY_LOSSES[options.loss_type].normaliser, options)
    if inputs.token_weights is not None:
        omega = omega * inputs.layout.padded(inputs.token_weights).to(dtype)  # [B, T]
    if inputs.sequence_weights is not None:
        omega = omega * inputs.sequence_weights.to(dtype)[:, None]  # [B, T]
    return omega


def chunk_loss(
    inputs: LossInputs, kept: tuple[Tensor, Tensor], options: LossOptions, row_mask: Tensor | None, dtype: torch.dtype
) -> ChunkLoss:
    """A token-level loss as `(rows, logp, entropy) -> (that chunk's share of the loss, dL/dlogp, dL/dentropy)` for
    the fused lm_head, in `dtype`; the rows `row_mask` drops (None: none) are padding to it. In closed form
    (`grpo_loss_torch.token_loss`) where it computes the loss whole, else by autograd through the algebra."""
    omega = inputs.layout.padded_at_kept(token_omega(inputs, options, dtype), kept)  # [M]
    side = {
        name: inputs.layout.at_kept(getattr(inputs, name), kept)
        for name in ("old_logp", "ref_logp", "advantages", "is_ratio")
    }
    if fits_kernel_epilogue(options, CAPABILITIES["torch"].epilogue_kl):
        return _closed_form_share(omega, side, row_mask, TokenEpilogue.from_options(options), dtype)
    return _autograd_share(omega, side, row_mask, options, inputs.mask.sum().clamp(min=1))


def _closed_form_share(
    omega: Tensor, side: dict[str, Tensor | None], row_mask: Tensor | None, epilogue: TokenEpilogue, dtype
) -> ChunkLoss:
    side = {name: None if x is None else x.to(dtype) for name, x in side.items()}  # [M] each

    def share(rows: slice, logp: Tensor, entropy: Tensor | None) -> tuple[Tensor, Tensor, None]:
        pick = lambda x: None if x is None else x[rows]  # noqa: E731  [c]
        mask = None if row_mask is None else row_mask[rows]
        loss, dlogp = grpo_loss_torch.token_loss(
            logp, mask, omega[rows], *(pick(side[k]) for k in ("advantages", "old_logp", "ref_logp", "is_ratio")),
            epilogue,
        )  # fmt: skip
        return loss.sum(), dlogp, None

    return share


def _autograd_share(
    omega: Tensor, side: dict[str, Tensor | None], row_mask: Tensor | None, options: LossOptions, num_kept: Tensor
) -> ChunkLoss:
    """`num_kept`: the batch's kept-token count, a tensor (no host sync), the entropy bonus's denominator."""

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

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

from grpo_kernels.engine import finite
from grpo_kernels.engine.plan import KeptRows, Plan, Route
from grpo_kernels.kernels import logits_driver
from grpo_kernels.kernels.backend import CAPABILITIES
from grpo_kernels.kernels.fused_linear import ChunkLoss, fused_linear_logprobs, fused_linear_token_loss
from grpo_kernels.kernels.fused_linear_lean import lean_linear_logprobs
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.replay import REPLAY_STATS
from grpo_kernels.kernels.torch import grpo_loss as grpo_loss_torch
from grpo_kernels.losses import token_loss
from grpo_kernels.losses.epilogue import TokenEpilogue, fits_kernel_epilogue
from grpo_kernels.losses.loss import GRPOLossOutput, compute_loss, loss_metrics
from grpo_kernels.losses.terms import per_sequence_or_token

if TYPE_CHECKING:
    from grpo_kernels.engine.inputs import LossInputs
    from grpo_kernels.options import LossOptions


def vocab_pass(plan: Plan) -> dict[str, Tensor]:
    """The plan's vocabulary pass: {"logp", "entropy" (when computed), each asked statistic}, [R, C] each (the fused
    lm_head's kept rows scattered back), logp NaN at unchecked targets outside [0, V)."""
    opts, kept, shard, layout = plan.pass_options, plan.kept, plan.shard, plan.layout
    if kept is None:  # logits in
        out = logits_driver.logits_pass(layout.rows, layout.targets, layout.mask, opts, shard)
    else:  # the fused lm_head on the kept rows [M, H], scattered back to [R, C]: row chunks ("fast") or 2-D tiles
        rows = (_take(kept, layout.rows), plan.source.weight, plan.source.bias, _take(kept, layout.targets))
        if opts.memory == "lean":
            out = lean_linear_logprobs(*rows, opts=opts, row_mask=kept.row_mask)
        else:
            out = fused_linear_logprobs(*rows, opts=opts, row_mask=kept.row_mask, shard=shard)
        out = {name: _scatter(kept, x, layout.mask) for name, x in out.items()}
    out["logp"] = _nan_at_invalid(out["logp"], layout.invalid)
    _check_kept_mass(plan, out, layout.mask)
    return out


def _check_kept_mass(plan: Plan, stats: dict[str, Tensor], mask: Tensor) -> None:
    """The rows of a call replaying kept ids, checked: NaN or +inf outside the kept set is refused
    (`finite.check_kept_mass`; a rule's thresholds take the whole row, so its support's lse already shows them)."""
    opts = plan.pass_options
    if opts.replay is not None and opts.replay.kept_ids is not None and opts.row_check is not None:
        finite.check_kept_mass(stats["log_kept_mass"], mask, opts.row_check)


def logprobs(plan: Plan):
    """token_logprobs / fused_linear_token_logprobs: logp, (logp, entropy) or the dict with the statistics."""
    out = {name: x[0] if plan.layout.flat else x for name, x in vocab_pass(plan).items()}  # [B, T] / [N]
    if plan.stats:
        return {name: x for name, x in out.items() if name in ("logp", "entropy", *plan.stats)}
    return (out["logp"], out["entropy"]) if plan.pass_options.with_entropy else out["logp"]


def two_phase(plan: Plan):
    """The pass, then `compute_loss` on its log-probs; with `(output, sequence_losses)` and / or the pass's
    log-probs when asked (`loss_result`)."""
    out = vocab_pass(plan)
    terms = plan.inputs.terms(out["logp"], out.get("entropy"), plan.options)
    output, sequence_losses = compute_loss(terms, plan.options)
    output.metrics.update(replay_metrics(out, plan.layout.mask))
    return loss_result(plan, output, sequence_losses, out)


def loss_result(plan: Plan, output: GRPOLossOutput, sequence_losses: Tensor | None, stats: dict[str, Tensor]):
    """A loss call's result: `output`, then `sequence_losses` and the pass's detached log-probs where asked
    ({"logp", each replay statistic}, in the caller's layout: [B, T] / [N])."""
    result = (output,)
    if plan.return_sequence_losses:
        result += (sequence_losses,)
    if plan.return_logprobs:
        names = ("logp", *(name for name in REPLAY_STATS if name in stats))
        result += ({name: (stats[name][0] if plan.layout.flat else stats[name]).detach() for name in names},)
    return result if len(result) > 1 else output


def fused_epilogue(plan: Plan) -> GRPOLossOutput:
    """One kernel pass: each token's weighted loss and dL/dlogp come out of the forward kernel's epilogue."""
    inputs, options, layout = plan.inputs, plan.options, plan.layout
    sides = logits_driver.LossSides(
        weights=token_omega(inputs, options, compute_dtype(layout.rows.dtype)),
        advantages=per_sequence_or_token(inputs.advantages),  # [B, 1] or [B, T]
        old_logp=inputs.old_logp,
        ref_logp=inputs.ref_logp,
        is_ratio=per_sequence_or_token(inputs.is_ratio),
    )
    loss, logp, entropy = logits_driver.fused_token_loss(
        layout.rows,
        layout.targets,
        layout.mask,
        sides,
        opts=plan.pass_options,
        epilogue=TokenEpilogue.from_options(options),
    )
    if layout.invalid is not None:
        loss, logp = logits_driver.poisoned(loss, layout.invalid), _nan_at_invalid(logp, layout.invalid)
    terms = inputs.terms(logp, entropy, options)  # for the metrics
    return GRPOLossOutput(loss, loss_metrics(terms, options))


def linear_token_loss(plan: Plan):
    """The fused lm_head with a token-level loss's gradients formed in its forward (3 GEMMs); with `plan.old_pass`
    a no-grad pass first gives π_old (1 GEMM)."""
    inputs, kept, options, layout = plan.inputs, plan.kept, plan.options, plan.layout
    if plan.old_pass:
        with torch.no_grad():
            inputs = inputs.with_own_old_logp(vocab_pass(plan)["logp"])
    loss, logp, entropy, stats = fused_linear_token_loss(
        _take(kept, layout.rows),
        plan.source.weight,
        plan.source.bias,
        _take(kept, layout.targets),
        opts=plan.pass_options,
        chunk_loss=chunk_loss(inputs, kept.index, options, kept.row_mask, compute_dtype(layout.rows.dtype)),
        row_mask=kept.row_mask,
    )
    logp = _nan_at_invalid(_scatter(kept, logp, layout.mask), layout.invalid)
    terms = inputs.terms(logp, _scatter(kept, entropy, layout.mask), options)
    loss = loss if layout.invalid is None else logits_driver.poisoned(loss, layout.invalid)
    stats = {name: _scatter(kept, x, layout.mask) for name, x in stats.items()}
    _check_kept_mass(plan, stats, layout.mask)
    output = GRPOLossOutput(loss, loss_metrics(terms, options) | replay_metrics(stats, layout.mask))
    return loss_result(plan, output, None, stats | {"logp": logp})


def replay_metrics(stats: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """With sampling replay, the kept tokens' mean log kept mass and the fraction of targets outside the support
    ("sampling/log_kept_mass", "sampling/outside_support"); nothing without replay. Summed in float64, then
    float32: the same floats from packed `[N]` and padded `[B, T]` layouts (whose float32 sums run in other orders,
    which the CPU's vector width changes)."""
    names = [name for name in REPLAY_STATS if name in stats]
    if not names:  # no op without replay: at small shapes ops are the host time
        return {}
    count = mask.sum().clamp(min=1)
    return {f"sampling/{name}": ((stats[name].double() * mask).sum() / count).float() for name in names}


def token_omega(inputs: LossInputs, options: LossOptions, dtype: torch.dtype) -> Tensor:
    """Each token's weight in the padded view (`losses.token_loss.token_omega`), in `dtype`."""
    return token_loss.token_omega(inputs.mask, inputs.token_weights, inputs.sequence_weights, options, dtype)


def padded_at(inputs: LossInputs, kept: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The kept rows' (row, column) indices in the padded view."""
    r, c = kept
    index = inputs.layout.padded_index
    return (r, c) if index is None else (index[0][c], index[1][c])


def kept_omega(inputs: LossInputs, kept: tuple[Tensor, Tensor], options: LossOptions, dtype: torch.dtype) -> Tensor:
    """ω (`token_omega`) at the kept rows `[M]`, in `dtype`."""
    return token_omega(inputs, options, dtype)[padded_at(inputs, kept)]


def chunk_loss(
    inputs: LossInputs,
    kept: tuple[Tensor, Tensor],
    options: LossOptions,
    row_mask: Tensor | None,
    dtype: torch.dtype,
    omega: Tensor | None = None,
) -> ChunkLoss:
    """A token-level loss as `(rows, logp, entropy) -> (that chunk's share of the loss, dL/dlogp, dL/dentropy)` for
    the fused lm_head, in `dtype`; the rows `row_mask` drops (None: none) are padding to it; `omega`: each kept row's
    ω `[M]` where the caller formed it already (`kept_omega`). In closed form (the torch epilogue's
    `closed_form_share`) where it computes the loss whole, else by autograd through the algebra
    (`losses.token_loss.autograd_share`). A sampler correction of the pass's own log-probs
    (`LossInputs.ratio_reads_pass`) is formed from each chunk's log-probs before its share."""
    at = padded_at(inputs, kept)
    at_kept = lambda x, at=at: None if x is None else (x[at] if x.dim() == 2 else x[at[0]])  # noqa: E731  [M]
    omega = at_kept(token_omega(inputs, options, dtype)) if omega is None else omega  # [M]
    side = {name: at_kept(getattr(inputs, name)) for name in ("old_logp", "ref_logp", "advantages", "is_ratio")}
    closed_form = fits_kernel_epilogue(options, CAPABILITIES["torch"].epilogue_kl)

    def share_of(omega: Tensor, side: dict[str, Tensor | None], row_mask: Tensor | None) -> ChunkLoss:
        if closed_form:
            return grpo_loss_torch.closed_form_share(omega, side, row_mask, TokenEpilogue.from_options(options), dtype)
        return token_loss.autograd_share(omega, side, row_mask, options, inputs.mask.sum().clamp(min=1))

    if not inputs.ratio_reads_pass:
        return share_of(omega, side, row_mask)

    def own_ratio_share(rows: slice, logp: Tensor, entropy: Tensor | None):
        chunk_at = (at[0][rows], at[1][rows])
        chunk_side = {name: None if x is None else x[rows] for name, x in side.items()}
        chunk_side["is_ratio"] = at_kept(inputs.own_is_ratio(logp, chunk_at), chunk_at)  # [c]
        chunk_mask = None if row_mask is None else row_mask[rows]
        return share_of(omega[rows], chunk_side, chunk_mask)(slice(0, logp.shape[0]), logp, entropy)

    return own_ratio_share


def _take(kept: KeptRows, x: Tensor) -> Tensor:
    """x [R, C, ·] at the kept rows, [M, ·] (every row: a view, no gather)."""
    return x[kept.index] if kept.row_mask is None else x.flatten(0, 1)


def _scatter(kept: KeptRows, values: Tensor | None, mask: Tensor) -> Tensor | None:
    """Kept-row values [M] back into rows [R, C] (0 elsewhere); differentiable."""
    if values is None:
        return None
    return values.new_zeros(mask.shape).index_put(kept.index, values)


def _nan_at_invalid(logp: Tensor, invalid: Tensor | None) -> Tensor:
    """logp, NaN at the kept tokens whose target was outside [0, V) (unchecked input)."""
    return logp if invalid is None else logp.masked_fill(invalid, float("nan"))


RUNS = {
    Route.LOGPROBS: logprobs,
    Route.TWO_PHASE: two_phase,
    Route.FUSED_EPILOGUE: fused_epilogue,
    Route.LINEAR_TOKEN_LOSS: linear_token_loss,
}


def run(plan: Plan):
    """Run the plan's route: the public function's result."""
    return RUNS[plan.route](plan)

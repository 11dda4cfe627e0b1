"""The teacher term of a GRPO step, for recipes that mix RL with on-policy distillation:

    loss = the GRPO loss + teacher_kl_coef · Σ_t ω_t · D_t

D_t is the two-head divergence (`LossOptions.teacher_divergence`, `fused_linear_divergence`'s options) between the
student (the policy's hidden states and lm_head, with the loss's own logit_scale / final_logit_softcapping) and a
teacher at token t; ω_t is the weight the loss type gives token t's own loss (its normaliser times token_weights and
sequence_weights: `losses.token_loss.token_omega`). So the term reduces as the loss does, as TRL adds its KL penalty
β·KL_t to each token's loss before the loss type's reduction and verl aggregates its KL loss with the policy loss's
loss_agg_mode; `teacher_kl_coef` is then on β's scale.

Two ways it runs (`run_with_teacher`):
- one pass, where the plan forms a token-level loss in the fused lm_head's forward (route LINEAR_TOKEN_LOSS, no
  sampling replay): the two-head divergence's chunked pass (`kernels/divergence.py`) with the GRPO loss as its
  `ChunkTerm` (`GRPOChunk`), one summed gradient: 4 GEMMs per chunk (both heads' logits, the student's dH and dW)
  against the plain step's 3. Where the loss's transform is the divergence's student's, its log-probs and entropy
  come from the divergence's sweeps and its gradient joins the divergence's last sweep (one student vocabulary pass,
  two `[rows, V]` float32 buffers); else it runs its own pass on each chunk's logits (a third buffer);
- two passes everywhere else (sequence-level losses, memory="lean", sampling replay, no gradient taken): the plan's
  route as without the term, then the divergence's own pass with the row weights ω.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels.distillation import check_float, check_heads, check_rows, divergence_options
from grpo_kernels.engine.plan import Plan, Route
from grpo_kernels.engine.routes import chunk_loss, kept_omega, run
from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.divergence import fused_linear_divergence_rows, shared_sweeps_refusal
from grpo_kernels.kernels.fused_linear import ChunkLoss, TokenLossStep
from grpo_kernels.kernels.logits_driver import checked_rows, poisoned
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs, compute_dtype
from grpo_kernels.kernels.torch.divergence import Head
from grpo_kernels.losses.loss import GRPOLossOutput, loss_metrics

Teacher = tuple[Tensor | None, Tensor | None, Tensor | None]  # teacher_hidden, teacher_weight, teacher_bias


class GRPOChunk:
    """The GRPO token-level loss on the student's rows inside the two-head pass (a `ChunkTerm`): each chunk's logp
    and entropy (from the divergence's sweeps, or from `own_pass`) give its share, dL/dlogp and dL/dentropy
    (`TokenLossStep`, its gradients watched by their sum); keeps each chunk's logp and entropy, and the own pass's
    lse."""

    def __init__(self, targets: Tensor, opts: PassOptions, chunk_loss: ChunkLoss, dtype: torch.dtype):
        self.targets, self.opts = targets, opts
        self.step = TokenLossStep(chunk_loss, True, dtype, targets.device)
        self.parts: dict[str, list[Tensor]] = {"logp": [], "lse": [], "entropy": []}

    def __call__(self, rows: slice, logp: Tensor, entropy: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        self.parts["logp"].append(logp)
        if entropy is not None:
            self.parts["entropy"].append(entropy)
        return self.step(rows, logp, entropy)

    def own_pass(self, rows: slice, logits: Tensor, grad_out: Tensor | None) -> None:
        """The backend's vocabulary pass on a chunk's raw logits `[c, V]`, then dL/dlogits into `grad_out`."""
        opts, z, targets = self.opts, logits[None], self.targets[None, rows]
        kernels = backends.kernels_of(opts.backend)
        mask = torch.ones_like(targets, dtype=torch.bool)  # [1, c]: the rows were gathered
        args = VocabPassArgs(logits=z, targets=targets, mask=mask, **{**opts.pass_fields, "stats": ()})
        logp, lse, entropy, _ = kernels.token_logprobs_fwd(args)
        self.parts["lse"].append(lse[0])
        grad_logp, grad_entropy = self(rows, logp[0], entropy[0] if opts.with_entropy else None)
        if grad_out is None:
            return
        grads = RowGrads(
            lse=lse[0],
            entropy=None if grad_entropy is None else entropy[0],
            grad_logp=grad_logp,
            grad_entropy=grad_entropy,
        ).at(None)  # [1, c] each
        kernels.token_logprobs_bwd(args, grads, grad_out[None])

    def loss(self) -> Tensor:
        return self.step.loss()

    def joined(self, name: str, like: Tensor) -> Tensor | None:
        """The chunks' `name` values `[M]` (None for an entropy not computed)."""
        parts = self.parts[name]
        if name == "entropy" and not self.opts.with_entropy:
            return None
        return torch.cat(parts) if parts else like.new_zeros(0, dtype=torch.float32)


def check_teacher(plan: Plan, teacher: Teacher) -> None:
    """The teacher's tensors against the plan's student (its hidden states' leading dims, one V, one device), or
    the refusals of the routes the term does not run on; nothing when the term is off."""
    coef, (hidden, weight, bias) = plan.options.teacher_kl_coef, teacher
    if coef == 0.0:
        return
    if hidden is None or weight is None:
        raise ValueError(f"teacher_kl_coef={coef} needs teacher_hidden and teacher_weight (the teacher's head)")
    for name, x in (("teacher_hidden", hidden), ("teacher_weight", weight)):
        check_float(name, x)
    source = plan.source
    check_heads(source.x, source.weight, None, hidden, weight, bias, student="")
    k = divergence_of(plan).top_k
    if k >= source.weight.shape[0]:
        raise ValueError(f"teacher_divergence top_k must be < V = {source.weight.shape[0]}, got {k}")
    refused = {
        "process_group": plan.shard is not None,
        "sequence_group": plan.inputs.sequence_group is not None,
        "return_sequence_losses": plan.return_sequence_losses,
        "sampler_correction and old_logp None (π_old the pass's own)": plan.inputs.ratio_reads_pass,
        "a CUDA graph capture with check_finite=False": plan.kept.row_mask is not None,
    }
    for what, present in refused.items():
        if present:
            raise ValueError(f"teacher_kl_coef > 0 does not run with {what} (the teacher term's rows are gathered and "
                             "whole on this rank)")  # fmt: skip


def divergence_of(plan: Plan):
    """The term's `DivergenceOptions`: the loss's `teacher_divergence` (or the defaults), the student's head
    transform the loss's own, rows per chunk the plan's."""
    options = plan.options
    return dataclasses.replace(
        options.teacher_divergence or divergence_options(),
        student=Head(options.logit_scale, options.final_logit_softcapping),
        chunk_size=plan.pass_options.chunk_size or 128,
    )


def run_with_teacher(plan: Plan, teacher: Teacher) -> GRPOLossOutput:
    """The plan's loss with the teacher term (`run(plan)` when teacher_kl_coef is 0): one pass where the plan forms
    a token-level loss in the fused lm_head's forward, else two (module docstring)."""
    options = plan.options
    if options.teacher_kl_coef == 0.0:
        return run(plan)
    layout, kept, source = plan.layout, plan.kept, plan.source
    dtype = compute_dtype(source.weight.dtype)
    hidden, weight, bias = teacher
    student = (layout.rows[kept.index], source.weight, source.bias)  # [M, H]
    teacher_rows = ((hidden[None] if layout.flat else hidden)[kept.index], weight, bias)  # [M, H_t]
    omega = kept_omega(plan.inputs, kept.index, options, dtype)  # [M]
    weights = options.teacher_kl_coef * omega
    divergence = divergence_of(plan)
    if plan.route is Route.LINEAR_TOKEN_LOSS and plan.pass_options.replay is None:
        output, details, logprobs = _one_pass(plan, student, teacher_rows, (omega, weights), divergence)
    else:
        result = run(plan)
        output, *logprobs = result if plan.return_logprobs else (result,)  # (output, logprobs)
        total, details = fused_linear_divergence_rows(student, teacher_rows, None, None, divergence, weights)
        output = GRPOLossOutput(output.loss + total, output.metrics)
        logprobs = logprobs[0] if logprobs else {}
    if plan.pass_options.row_check is not None:
        flat = kept.index[0] * layout.rows.shape[1] + kept.index[1]  # [M] in the user's flattened tokens
        check_rows(details["lse_t"], "teacher", flat, torch.Size(layout.leading))
    count = max(details["divergence"].numel(), 1)
    metrics = output.metrics | {"teacher/divergence": details["divergence"].detach().sum() / count}
    output = GRPOLossOutput(output.loss, metrics)
    return (output, logprobs) if plan.return_logprobs else output


def _one_pass(plan: Plan, student, teacher_rows, omega: tuple[Tensor, Tensor], divergence):
    """The GRPO loss and the weighted divergence from one chunked pass over both heads (`GRPOChunk`; `omega`: ω and
    the divergence's row weights at the kept rows), the pass's details, and its detached log-probs {"logp"} in the
    caller's layout. Where the GRPO loss's transform is the divergence's student's, its logp, lse and entropy come
    from the divergence's sweeps (`shared_sweeps_refusal`), else from its own pass on each chunk."""
    inputs, kept, options, layout, opts = plan.inputs, plan.kept, plan.options, plan.layout, plan.pass_options
    dtype = compute_dtype(plan.source.weight.dtype)
    targets = layout.targets[kept.index]  # [M]
    term = GRPOChunk(targets, opts, chunk_loss(inputs, kept.index, options, None, dtype, omega[0]), dtype)
    total, details = fused_linear_divergence_rows(student, teacher_rows, None, None, divergence, omega[1], term)
    like = student[0]
    lse = term.joined("lse", like) if shared_sweeps_refusal(opts, divergence) else details["lse_s"]
    logp = checked_rows(opts.row_check, lse, term.joined("logp", like), None)
    scatter = lambda x: None if x is None else x.new_zeros(layout.mask.shape).index_put(kept.index, x)  # noqa: E731
    logp = scatter(logp)
    if layout.invalid is not None:
        logp, total = logp.masked_fill(layout.invalid, float("nan")), poisoned(total, layout.invalid)
    terms = inputs.terms(logp, scatter(term.joined("entropy", like)), options)
    logprobs = {"logp": (logp[0] if layout.flat else logp).detach()}
    return GRPOLossOutput(total, loss_metrics(terms, options)), details, logprobs

"""The public functions: each checks its arguments' types, builds one plan (`engine/plan.py`: backend, checks,
layout, route) and runs it (`engine/routes.py`). Their arguments reach the plan by name, as records
(`TokenTensors` / `LossTensors`, `Request`) whose fields bear the same names."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.engine.plan import Source, build_plan
from grpo_kernels.engine.replay import SamplingMask
from grpo_kernels.engine.routes import run
from grpo_kernels.engine.validate import check_argument_types
from grpo_kernels.losses.loss import GRPOLossOutput
from grpo_kernels.losses.sampler_ratio import SamplerCorrection
from grpo_kernels.options import LossOptions, resolve_options
from grpo_kernels.teacher_term import check_teacher, run_with_teacher

LossResult = (
    GRPOLossOutput
    | tuple[GRPOLossOutput, Tensor]  # return_sequence_losses
    | tuple[GRPOLossOutput, dict[str, Tensor]]  # return_logprobs
    | tuple[GRPOLossOutput, Tensor, dict[str, Tensor]]  # both
)


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    with_entropy: bool = False,
    stats: tuple[str, ...] = (),
    mask: Tensor | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    sampling_mask: SamplingMask | Tensor | None = None,
    inplace: bool = True,
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> Tensor | tuple[Tensor, Tensor] | dict[str, Tensor]:
    """Log-probability of each target token under softmax(z / temperature), and optionally its entropy.

    z = logit_scale · logits, then c·tanh(z/c) with c = `final_logit_softcapping` when set (Gemma 2/3; TRL's
    order and names; `integrations.hf.logit_transform` reads both from a model's config).
    logits `[B, T, V]` or `[N, V]` (bf16, fp16, fp32), targets `[B, T]` / `[N]`; returns float32 `[B, T]` / `[N]`
    (`(logp, entropy)` with `with_entropy`). Rows where `mask` is 0 are not read and give 0. Differentiable
    w.r.t. logits (through logp and entropy); with `inplace=True` the backward writes the gradient into the
    logits' own buffer (no [N, V] allocation), so the logits' values are gone afterwards.

    `stats` asks for extra per-token statistics from the same pass (torch and triton backends), as TRL's
    `ChunkedLogProbFunction` computes them: `"log_sum_sq_probs"` (log Σ_v π_v², for verl's optimal-token
    baseline), `"mean_logits"` (the mean over V of z / temperature), `"is_top1"` (bool: the target is the first
    argmax). Then the result is a dict {"logp", "entropy" (with `with_entropy`), each asked name}, same shapes;
    the statistics carry no gradient (as in TRL) and are 0 / False at masked rows.

    `check_finite=True`: a kept row whose log-sum-exp is not finite (NaN or ±inf logits, or an overflowing
    transform) is a ValueError naming its index, found from the pass's O(N) statistics. A target whose logit is
    -inf gets logp = -inf, as in TRL. The checks that read values (target range and mask values before the pass,
    the rows after it) cost two host syncs. `check_finite=False` skips them all, so the call never waits on the
    device (it can be captured in a CUDA graph): such rows, and kept targets outside [0, V), then give NaN.
    Calling it on logits an in-place backward has overwritten is a ValueError.

    Vocabulary parallel: with `process_group`, logits `[..., V_r]` are this rank's columns [vocab_start,
    vocab_start + V_r) of the whole vocabulary (`vocab_start` None: the ranks' shards in rank order); targets are
    whole-vocabulary ids, and every rank gets the whole vocabulary's logp and entropy (`kernels.parallel`: O(N)
    statistics cross ranks, 16·R + 4·(3 + with_entropy)·B·T bytes per call; no stats).

    Sampling replay (docs/sampling_replay.md): log-probs renormalised over the tokens a truncated sampler kept, so that
    they compare with the sampler's own. Rule replay applies the sampler's rule to z (after the temperature) in vLLM's
    order: `min_p` (0.0: off) on the whole distribution, then `top_k` (0 or >= V: off), then `top_p` (1.0: off) on what
    is left; every token tied at a cut is kept. Kept-set replay takes the kept ids themselves: `sampling_mask`, a
    `SamplingMask(token_ids, offsets)` (vLLM's CSR) or an int tensor `[B, T, K]` / `[N, K]` with -1 padding (not with
    the rule options); each position's ids are a set (an id given twice counts once), and an empty set where `mask`
    keeps the position is a ValueError naming it (`check_finite` also refuses NaN or +inf outside the set). The entropy
    is the support's; the gradient is onehot − q_support inside the support and 0 outside (the support held fixed). A
    target outside the support is counted as kept and flagged. `stats` may ask for `"log_kept_mass"` (log S =
    lse_support − lse_full, ≤ 0; 0 without truncation and at masked rows) and `"outside_support"` (bool: the target lay
    outside and was counted as kept), on every backend. On vocabulary shards (`process_group`) the rule's thresholds are
    merged over the ranks (min-p: the row's max; top-k: each shard's k largest logits all-gathered, R·k floats a row;
    top-p walks those candidates, so it needs 1 <= top_k <= 1024 there) and kept ids are split by shard. A
    `sampling_mask` is checked and padded with host reads even with `check_finite=False`; top_p with top_k reads one
    flag per window (a tie at the k-th), except inside a torch.compile trace or a CUDA graph capture.
    """
    args = check_argument_types(locals())  # the call's arguments as one record
    return run(build_plan(source=Source(logits), arguments=args))


def fused_linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    with_entropy: bool = False,
    stats: tuple[str, ...] = (),
    mask: Tensor | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    sampling_mask: SamplingMask | Tensor | None = None,
    chunk_size: int | None = None,
    memory: str = "auto",
    tile: tuple[int, int] | None = None,
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
    head_precision: str = "auto",
) -> Tensor | tuple[Tensor, Tensor] | dict[str, Tensor]:
    """`token_logprobs(hidden @ weight.T + bias, targets)` without the `[N, V]` logits: chunks of rows go
    through the lm_head GEMM and the vocabulary pass one at a time. hidden `[B, T, H]` or `[N, H]`, weight
    `[V, H]`, bias `[V]`; differentiable w.r.t. hidden, weight and bias. Masked rows are gathered out first: their
    count is read on the host with the checks' first sync (with `check_finite=False` that read is the one sync;
    inside a CUDA graph capture every row runs instead, masked, and nothing is read).
    `logit_scale`, `final_logit_softcapping`, `stats` (a dict result) and `check_finite` as in `token_logprobs`
    (a non-finite row names hidden, weight and bias); every token masked, B = 0 or T = 0 give zeros.
    `memory` trades memory for time: "fast" runs chunks of rows over the whole vocabulary (`chunk_size` rows; dW
    summed in a float32 `[V, H]` buffer); "lean" runs 2-D tiles of rows × vocabulary columns (`tile=(rows, vocab)`,
    default from a memory budget and the dtypes) and a vocabulary-major backward that computes each tile's logits
    again (one GEMM more) and writes dW once in the weight's dtype: extra memory ≈ dW + dH + one tile (+ dH in
    float32 for bf16/fp16); torch and triton backends. "auto" picks "lean" when the float32 dW buffer and a chunk
    would not fit in half the free memory, or `tile` is given, else "fast" (`engine/memory.resolve_memory`).
    `process_group` / `vocab_start` as in `token_logprobs`, weight `[V_r, H]` (bias `[V_r]`) being this rank's rows
    of the lm_head: dW of the shard, dH summed over the group; 16·R + (4·(3 + with_entropy) + H·itemsize)·M bytes
    per forward + backward, M the kept tokens. `head_precision` ("auto": the weight's dtype, "bf16", "tf32",
    "fp32") is the logits GEMM's precision; the gradient GEMMs stay in the weight's dtype (docs/head_precision.md).
    `top_k`, `top_p`, `min_p`, `sampling_mask` (positions: the flattened targets) replay a truncated sampler as in
    `token_logprobs`, each chunk's logits masked in a float32 scratch window; "lean" memory cannot (its tiles never
    hold a row whole: a ValueError), and "auto" picks "fast" under replay."""
    args = check_argument_types(locals())  # the call's arguments as one record
    return run(build_plan(source=Source(hidden, weight, bias), arguments=args))


def grpo_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    is_ratio: Tensor | None = None,
    sampling_logp: Tensor | None = None,
    token_weights: Tensor | None = None,
    sequence_weights: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    sampling_mask: SamplingMask | Tensor | None = None,
    sampler_correction: SamplerCorrection | None = None,
    return_sequence_losses: bool = False,
    with_entropy: bool = False,
    inplace: bool = True,
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_group: torch.distributed.ProcessGroup | None = None,
    options: LossOptions | None = None,
    **loss_options,
) -> LossResult:
    """GRPO-family loss on logits `[B, T, V]`, with TRL's argument names and semantics.

    targets `[B, T]` (logits[b, t] predicts targets[b, t]), advantages `[B]` or `[B, T]`, old_logp / ref_logp
    `[B, T]` (old_logp None = on-policy), mask `[B, T]` (None = all tokens), is_ratio `[B]` or `[B, T]` (rollout
    importance weight), sampling_logp `[B, T]` (the sampler's log-probs for `off_policy_mask_threshold`; None =
    old_logp). `token_weights [B, T]` and `sequence_weights [B]` multiply each token's loss (policy and
    KL terms; TR-GRPO, λ-GRPO, DARO), differentiably. Loss options are `LossOptions` fields, as keywords
    (`loss_type="dapo"`, `beta=0.04`, ...) or one `options=LossOptions(...)`. `with_entropy` adds the `entropy`
    metric (computed anyway when `top_entropy_quantile < 1` or `entropy_coef != 0`). The backward writes dL/dlogits
    into the logits buffer unless `inplace=False`; a later call on logits it overwrote is a ValueError.
    `check_finite=True`: NaN or ±inf at a kept token in advantages, old_logp, ref_logp, sampling_logp, is_ratio or
    the weights, or a kept row of logits with a non-finite log-sum-exp (from the pass's O(N) statistics, never
    another pass over `[B, T, V]`), or a target whose logit is -inf (probability 0: the ratio and log terms are
    undefined), is a ValueError naming the tensor and the first bad index; two host syncs (one before the pass for
    the inputs' values and the target range, one after it for the rows), O(B·T) work (README: the measured cost).
    `check_finite=False` skips them all (no host sync: the step can be captured in a CUDA graph; the packed layout,
    `top_entropy_quantile < 1` and clip_cov / kl_cov still read values); the loss is then NaN wherever a gradient
    would be, and wherever a kept target lies outside [0, V).
    Every token masked, B = 0 or T = 0: loss 0 and zero gradients.
    Returns `GRPOLossOutput(loss, metrics)`, and with `return_sequence_losses` also each sequence's share of the
    loss `[B]` (before the entropy bonus; differentiable), as `(output, sequence_losses)`.

    Packed layout: with `cu_seqlens` (int `[S + 1]`), logits are `[N, V]`, per-token tensors `[N]`, advantages
    and is_ratio `[S]` or `[N]`, sequence_weights `[S]`; padding never enters the vocabulary pass.

    `sampler_correction` (a `SamplerCorrection`: TRL's `vllm_importance_sampling_*` modes) forms `is_ratio` as
    π_old / π_sampler, per token or per sequence, from old_logp and `sampling_logp` (then required; is_ratio and
    rollout_correction refused); with old_logp None π_old is the pass's own log-probs, detached (π_θ at the
    update), and the call runs two-phase (the log-probs, then the ratio and the loss algebra).

    Sampling replay (as in `token_logprobs`): the LossOptions `top_k`, `top_p`, `min_p`, or `sampling_mask`
    (`SamplingMask` or `[B, T, K]` / packed `[N, K]` ids, -1 padding) renormalise the policy's log-probs over the
    sampler's support; `replay_entropy="full"` keeps the whole distribution's entropy (one more ordinary pass).
    old_logp and ref_logp are taken as given (compute them replayed or not where they are made). The metrics then
    add "sampling/log_kept_mass" (the kept tokens' mean log S) and "sampling/outside_support" (the fraction of
    targets counted as kept from outside the support). The fused epilogue route runs two-phase under replay.

    `process_group` / `vocab_start`: logits are this rank's vocabulary shard, as in `token_logprobs`. Sequences
    split across the ranks of `sequence_group` (context parallel): with `cu_seqlens`, each rank holds its tokens of
    the same S sequences (a sequence may have none on a rank) and per-sequence values `[S]` alike on every rank;
    per-sequence sums and batch totals are all-reduced (`losses.reduce`), so the ranks' losses sum to the unsplit
    loss and each token gets its unsplit gradient.
    """
    args = check_argument_types(locals())  # the call's arguments as one record, cu_seqlens a tensor
    options = resolve_options(options, loss_options)
    if options.teacher_kl_coef != 0.0:
        raise ValueError(
            "teacher_kl_coef > 0 needs the teacher's hidden states and lm_head: use "
            "fused_linear_grpo_loss(hidden, weight, ..., teacher_hidden=..., teacher_weight=...)"
        )
    return run(build_plan(source=Source(logits), arguments=args, options=options))


def fused_linear_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    memory: str = "auto",
    tile: tuple[int, int] | None = None,
    is_ratio: Tensor | None = None,
    sampling_logp: Tensor | None = None,
    token_weights: Tensor | None = None,
    sequence_weights: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    sampling_mask: SamplingMask | Tensor | None = None,
    sampler_correction: SamplerCorrection | None = None,
    return_sequence_losses: bool = False,
    return_logprobs: bool = False,
    with_entropy: bool = False,
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_group: torch.distributed.ProcessGroup | None = None,
    head_precision: str = "auto",
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    options: LossOptions | None = None,
    **loss_options,
) -> LossResult:
    """`grpo_loss(hidden @ weight.T + bias, ...)` without the `[N, V]` logits; gradients for hidden, weight, bias.

    hidden `[B, T, H]` (packed: `[N, H]` with `cu_seqlens`), weight `[V, H]` (an lm_head's `.weight`), bias `[V]`;
    every other argument as in `grpo_loss`. Masked tokens are gathered out before the first GEMM. With
    memory="fast", token-level losses form their gradients in the forward (3 GEMMs per chunk of rows in all);
    sequence-level ones, per-sequence outputs and weights that need a gradient recompute each chunk's logits in the
    backward (4 GEMMs). `memory="lean"` (every loss type and option; 4 GEMMs) and "auto", `tile` and `chunk_size`
    as in `fused_linear_token_logprobs`.
    `check_finite` as in `grpo_loss` (a non-finite row names hidden, weight and bias); the gathering of the kept
    rows as in `fused_linear_token_logprobs`. `process_group` / `vocab_start` (weight `[V_r, H]`: this rank's rows
    of the lm_head) as in `fused_linear_token_logprobs`, `sequence_group` as in `grpo_loss`; either runs the
    4-GEMM route. `head_precision` as in `fused_linear_token_logprobs`. Sampling replay (`top_k`, `top_p`, `min_p`,
    `sampling_mask`) as in `grpo_loss`, on the "fast" route (3 or 4 GEMMs; "auto" picks it, "lean" is refused).

    `sampler_correction` (a `SamplerCorrection`: TRL's `vllm_importance_sampling_*` modes) forms `is_ratio` as
    π_old / π_sampler from old_logp and `sampling_logp` (then required; is_ratio and rollout_correction refused).
    With old_logp None, π_old is the pass's own log-probs, detached (π_θ at the update: no separate π_old pass),
    and the ratio is formed from them inside the loss, in each chunk of the 3-GEMM route: per token, or per sequence
    on chunks that end at sequence boundaries (whole sequences, at most the chunk's rows each; no separate pass).
    A call with a sequence longer than the chunk's rows (`chunk_size`, or the engine's choice), or with packed rows
    (`cu_seqlens`), keeps a no-grad pass over the kept rows first (1 GEMM more), its chunks uniform: the memory stays
    one chunk, and packed calls give their two-pass twin's floats.
    `return_logprobs` appends the pass's detached log-probs to the result, `{"logp", and with replay
    "log_kept_mass", "outside_support"}` in the layout of `targets`: `(output, logprobs)`, or `(output,
    sequence_losses, logprobs)`.

    Teacher term (on-policy distillation in the same step; `teacher_term.py`, docs/distillation.md): with the loss
    option `teacher_kl_coef` > 0, `teacher_hidden` `[B, T, H_t]` / `[N, H_t]` and the teacher's lm_head
    `teacher_weight` `[V, H_t]` (`teacher_bias` `[V]`), over the student's vocabulary, add teacher_kl_coef · Σ_t ω_t
    D_t: the divergence `teacher_divergence` per token, weighted as the loss type weighs that token's own loss. The
    teacher gets no gradient. It shares the token-level route's pass (4 GEMMs per chunk), else runs a second pass.
    """
    args = check_argument_types(locals())  # the call's arguments as one record, cu_seqlens a tensor
    options = resolve_options(options, loss_options)
    plan = build_plan(source=Source(hidden, weight, bias), arguments=args, options=options)
    teacher = (teacher_hidden, teacher_weight, teacher_bias)
    check_teacher(plan, teacher)
    return run_with_teacher(plan, teacher)

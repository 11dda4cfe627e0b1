"""The public functions: check -> pick backend -> vocabulary pass -> loss algebra -> GRPOLossOutput."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.engine import finite, sync, validate
from grpo_kernels.engine import layout as kept_rows
from grpo_kernels.engine import routes as token_level
from grpo_kernels.engine.inputs import LossInputs
from grpo_kernels.engine.layout import (
    as_rows,
    checked_mask,
    kept_index,
    layout_view,
    poison,
    row_check,
    safe_targets,
    scatter,
    take,
)
from grpo_kernels.kernels import parallel, parallel_linear
from grpo_kernels.kernels.backend import resolve_backend
from grpo_kernels.kernels.function import (
    VocabPassOptions,
    poisoned,
    vocab_pass,
    vocab_pass_with_stats,
)
from grpo_kernels.kernels.fused_linear import (
    LINEAR_ROWS,
    FusedLinearOptions,
    fused_linear_logprobs,
    fused_linear_logprobs_with_stats,
    fused_linear_token_loss,
)
from grpo_kernels.kernels.fused_linear_lean import resolve_memory
from grpo_kernels.losses.loss import GRPOLossOutput, compute_loss, loss_metrics
from grpo_kernels.options import LossOptions, resolve_options

LossResult = GRPOLossOutput | tuple[GRPOLossOutput, Tensor]


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
    """
    validate.check_temperature(temperature)
    validate.check_logit_transform(logit_scale, final_logit_softcapping)
    checks.check_tensor("logits", logits)
    squeeze = logits.dim() == 2
    rows, targets, mask = as_rows(logits, targets, mask)
    backend = resolve_backend(backend, logits.device)
    stats = validate.check_stats(stats, backend)
    validate.check_logits(rows, backend)
    shard = parallel.vocab_shard(process_group, rows.shape[-1], vocab_start, stats)
    vocab = rows.shape[-1] if shard is None else shard.vocab
    with sync.one_sync(check_finite):
        mask = checked_mask(mask, rows, targets, vocab=vocab)
    targets, invalid = safe_targets(targets, mask, vocab, check_finite)
    opts = VocabPassOptions(
        backend,
        temperature,
        with_entropy,
        inplace,
        logit_scale,
        final_logit_softcapping,
        stats,
        row_check(check_finite, finite.RowCheck(), squeeze),
    )
    if stats:
        out = vocab_pass_with_stats(rows, targets, mask, opts)
        out["logp"] = poison(out["logp"], invalid)
        return {name: x[0] for name, x in out.items()} if squeeze else out
    if shard is None:
        logp, entropy = vocab_pass(rows, targets, mask, opts)
    else:
        logp, entropy = parallel.vocab_pass(rows, targets, mask, opts, shard)
    logp = poison(logp, invalid)
    if squeeze:
        logp, entropy = logp[0], None if entropy is None else entropy[0]
    return (logp, entropy) if with_entropy else logp


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
    chunk_size: int | None = None,
    memory: str = "auto",
    tile: tuple[int, int] | None = None,
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
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
    would not fit in half the free memory, or `tile` is given, else "fast" (`fused_linear_lean.resolve_memory`).
    `process_group` / `vocab_start` as in `token_logprobs`, weight `[V_r, H]` (bias `[V_r]`) being this rank's rows
    of the lm_head: dW of the shard, dH summed over the group; 16·R + (4·(3 + with_entropy) + H·itemsize)·M bytes
    per forward + backward, M the kept tokens."""
    validate.check_temperature(temperature)
    validate.check_logit_transform(logit_scale, final_logit_softcapping)
    checks.check_tensor("hidden", hidden)
    squeeze = hidden.dim() == 2
    rows, targets, mask = as_rows(hidden, targets, mask, name="hidden")
    backend = resolve_backend(backend, hidden.device)
    stats = validate.check_stats(stats, backend)
    validate.check_linear(rows, weight, bias, backend)
    validate.check_chunk_size(chunk_size)
    tile = validate.check_memory(memory, tile, chunk_size, backend)
    shard = parallel.vocab_shard(process_group, weight.shape[0], vocab_start, stats)
    vocab = weight.shape[0] if shard is None else shard.vocab
    all_rows = kept_rows.all_rows(check_finite, hidden.device)
    with sync.one_sync(check_finite) as reads:
        mask = checked_mask(mask, rows, targets, vocab=vocab)
        if not all_rows:
            reads.read(mask.sum())  # the kept-row count sizes the gather: read with the checks
    targets, invalid = safe_targets(targets, mask, vocab, check_finite)
    kept, row_mask = kept_index(mask, None if all_rows else reads.numbers[0])
    memory = _memory_mode(memory, backend, shard, kept, weight, chunk_size, tile)
    opts = FusedLinearOptions(
        backend,
        temperature,
        with_entropy,
        chunk_size,
        logit_scale,
        final_logit_softcapping,
        stats,
        row_check(check_finite, LINEAR_ROWS, squeeze, kept),
        memory=memory,
        tile=tile,
    )
    if stats:
        out = fused_linear_logprobs_with_stats(
            take(rows, kept, row_mask), weight, bias, take(targets, kept, row_mask), opts, row_mask
        )
        out = {name: scatter(x, kept, mask) for name, x in out.items()}
        out["logp"] = poison(out["logp"], invalid)
        return {name: x[0] for name, x in out.items()} if squeeze else out
    pass_ = fused_linear_logprobs if shard is None else parallel_linear.on_shard(shard)
    logp_kept, entropy_kept = pass_(
        take(rows, kept, row_mask), weight, bias, take(targets, kept, row_mask), opts, row_mask
    )
    logp, entropy = poison(scatter(logp_kept, kept, mask), invalid), scatter(entropy_kept, kept, mask)
    if squeeze:
        logp, entropy = logp[0], None if entropy is None else entropy[0]
    return (logp, entropy) if with_entropy else logp


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

    `process_group` / `vocab_start`: logits are this rank's vocabulary shard, as in `token_logprobs`. Sequences
    split across the ranks of `sequence_group` (context parallel): with `cu_seqlens`, each rank holds its tokens of
    the same S sequences (a sequence may have none on a rank) and per-sequence values `[S]` alike on every rank;
    per-sequence sums and batch totals are all-reduced (`losses.reduce`), so the ranks' losses sum to the unsplit
    loss and each token gets its unsplit gradient.
    """
    options = resolve_options(options, loss_options)
    checks.check_tensor("logits", logits)
    backend = resolve_backend(backend, logits.device)
    validate.check_logits(layout_view("logits", logits, cu_seqlens), backend)
    shard = parallel.vocab_shard(process_group, logits.shape[-1], vocab_start)
    vocab = logits.shape[-1] if shard is None else shard.vocab
    tensors = (targets, advantages, old_logp, ref_logp, mask, is_ratio, token_weights, sequence_weights, cu_seqlens)
    with sync.one_sync(check_finite):
        inputs = _checked_inputs(logits, vocab, tensors, sampling_logp, options, check_finite)
    safe, invalid = safe_targets(inputs.targets, inputs.mask, vocab, check_finite)
    inputs = dataclasses.replace(inputs, targets=safe, vocab_shard=shard, sequence_group=sequence_group)
    rows = logits if inputs.layout is None else logits[None]  # [R, C, V]
    opts = VocabPassOptions(
        backend,
        options.temperature,
        _needs_entropy(options, with_entropy),
        inplace,
        options.logit_scale,
        options.final_logit_softcapping,
        finite=row_check(check_finite, finite.RowCheck(), inputs.layout is not None, loss=True),
    )
    in_kernel = (
        token_level.is_token_level(options, inputs)
        and options.top_entropy_quantile == 1.0
        and options.entropy_coef == 0.0
    )
    in_kernel = in_kernel and (options.beta == 0.0 or options.kl_estimator in token_level.FUSED_KL_ESTIMATORS)
    if backend in ("triton", "cuda") and inputs.layout is None and in_kernel and not return_sequence_losses:
        return token_level.fused_grpo_loss(rows, inputs, opts, options, invalid)
    if shard is None:
        logp, entropy = vocab_pass(rows, inputs.targets, inputs.mask, opts)  # [R, C] each
    else:
        logp, entropy = parallel.vocab_pass(rows, inputs.targets, inputs.mask, opts, shard)  # [R, C] each
    return _loss(inputs.terms(poison(logp, invalid), entropy, options), options, return_sequence_losses)


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
    return_sequence_losses: bool = False,
    with_entropy: bool = False,
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_group: torch.distributed.ProcessGroup | None = None,
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
    4-GEMM route.
    """
    options = resolve_options(options, loss_options)
    checks.check_tensor("hidden", hidden)
    backend = resolve_backend(backend, hidden.device)
    validate.check_linear(layout_view("hidden", hidden, cu_seqlens), weight, bias, backend)
    validate.check_chunk_size(chunk_size)
    tile = validate.check_memory(memory, tile, chunk_size, backend)
    shard = parallel.vocab_shard(process_group, weight.shape[0], vocab_start)
    vocab = weight.shape[0] if shard is None else shard.vocab
    all_rows = kept_rows.all_rows(check_finite, hidden.device)
    tensors = (targets, advantages, old_logp, ref_logp, mask, is_ratio, token_weights, sequence_weights, cu_seqlens)
    with sync.one_sync(check_finite) as reads:
        inputs = _checked_inputs(hidden, vocab, tensors, sampling_logp, options, check_finite)
        if not all_rows:
            reads.read(inputs.mask.sum())  # the kept-row count sizes the gather: read with the checks
    safe, invalid = safe_targets(inputs.targets, inputs.mask, vocab, check_finite)
    inputs = dataclasses.replace(inputs, targets=safe, vocab_shard=shard, sequence_group=sequence_group)
    rows = hidden if inputs.layout is None else hidden[None]  # [R, C, H]
    kept, row_mask = kept_index(inputs.mask, None if all_rows else reads.numbers[0])
    memory = _memory_mode(memory, backend, shard, kept, weight, chunk_size, tile)
    opts = FusedLinearOptions(
        backend,
        options.temperature,
        _needs_entropy(options, with_entropy),
        chunk_size,
        options.logit_scale,
        options.final_logit_softcapping,
        finite=row_check(check_finite, LINEAR_ROWS, inputs.layout is not None, kept, loss=True),
        memory=memory,
        tile=tile,
    )
    hidden_rows, target_rows = take(rows, kept, row_mask), take(inputs.targets, kept, row_mask)  # [M, H], [M]
    fast = memory == "fast" and not return_sequence_losses
    if fast and token_level.is_token_level(options, inputs) and options.top_entropy_quantile == 1.0:
        chunk_loss = token_level.chunk_loss(inputs, kept, options, row_mask)
        loss, logp, entropy = fused_linear_token_loss(
            hidden_rows, weight, bias, target_rows, opts, chunk_loss, row_mask
        )
        logp = poison(scatter(logp, kept, inputs.mask), invalid)
        terms = inputs.terms(logp, scatter(entropy, kept, inputs.mask), options)
        loss = loss if invalid is None else poisoned(loss, invalid)
        return GRPOLossOutput(loss, loss_metrics(terms, options))
    pass_ = fused_linear_logprobs if shard is None else parallel_linear.on_shard(shard)
    logp, entropy = pass_(hidden_rows, weight, bias, target_rows, opts, row_mask)  # [M] each
    logp = poison(scatter(logp, kept, inputs.mask), invalid)
    terms = inputs.terms(logp, scatter(entropy, kept, inputs.mask), options)
    return _loss(terms, options, return_sequence_losses)


def _checked_inputs(
    x: Tensor, vocab: int, tensors: tuple, sampling_logp: Tensor | None, options: LossOptions, check_finite: bool
) -> LossInputs:
    """A loss's inputs checked against logits / hidden `x` (shapes, dtypes, devices, mask and target values) and,
    with `check_finite`, for non-finite values at kept tokens; run inside the caller's `sync.one_sync`, so that
    every value read is one host sync."""
    inputs = LossInputs.check(tuple(x.shape[:-1]), vocab, x.device, *tensors, options, sampling_logp)
    if check_finite:
        inputs.check_finite(options)
    return inputs


def _memory_mode(
    memory: str, backend: str, shard, kept: tuple[Tensor, Tensor], weight: Tensor, chunk_size: int | None, tile
) -> str:
    """The fused lm_head's memory mode, "fast" or "lean" (`fused_linear_lean.resolve_memory`); a vocabulary shard
    (`process_group`) runs "fast"."""
    if shard is not None:
        if memory == "lean" or tile is not None:
            raise ValueError("memory='lean' (and tile) do not run with process_group (a vocabulary shard)")
        return "fast"
    return resolve_memory(memory, backend, kept[0].shape[0], weight, chunk_size, tile)


def _needs_entropy(options: LossOptions, with_entropy: bool) -> bool:
    return with_entropy or options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0


def _loss(terms, options: LossOptions, return_sequence_losses: bool) -> LossResult:
    output, sequence_losses = compute_loss(terms, options)
    return (output, sequence_losses) if return_sequence_losses else output

"""The public functions: check -> pick backend -> vocabulary pass -> loss algebra -> GRPOLossOutput."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.loss_inputs import LossInputs
from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.loss import GRPOLossOutput, compute_loss, loss_metrics, per_token_loss
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.losses.terms import build_terms, per_sequence_or_token
from grpo_kernels.options import LossOptions, resolve_options
from grpo_kernels.vocab import parallel, parallel_linear
from grpo_kernels.vocab.backends import resolve_backend
from grpo_kernels.vocab.function import (
    TokenEpilogue,
    VocabPassOptions,
    fused_token_loss,
    poisoned,
    vocab_pass,
    vocab_pass_with_stats,
)
from grpo_kernels.vocab.fused_linear import (
    LINEAR_ROWS,
    FusedLinearOptions,
    fused_linear_logprobs,
    fused_linear_logprobs_with_stats,
    fused_linear_token_loss,
)
from grpo_kernels.vocab.fused_linear_lean import resolve_memory

LossResult = GRPOLossOutput | tuple[GRPOLossOutput, Tensor]
FUSED_KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")  # those the fused epilogues implement (Triton, CUDA)


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
    whole-vocabulary ids, and every rank gets the whole vocabulary's logp and entropy (`vocab.parallel`: O(N)
    statistics cross ranks, 16·R + 4·(3 + with_entropy)·B·T bytes per call; no stats).
    """
    checks.check_temperature(temperature)
    checks.check_logit_transform(logit_scale, final_logit_softcapping)
    checks.check_tensor("logits", logits)
    squeeze = logits.dim() == 2
    rows, targets, mask = _rows(logits, targets, mask)
    backend = resolve_backend(backend, logits.device)
    stats = checks.check_stats(stats, backend)
    checks.check_logits(rows, backend)
    shard = parallel.vocab_shard(process_group, rows.shape[-1], vocab_start, stats)
    vocab = rows.shape[-1] if shard is None else shard.vocab
    with checks.one_sync(check_finite):
        mask = _checked_mask(mask, rows, targets, vocab=vocab)
    targets, invalid = _safe_targets(targets, mask, vocab, check_finite)
    opts = VocabPassOptions(
        backend,
        temperature,
        with_entropy,
        inplace,
        logit_scale,
        final_logit_softcapping,
        stats,
        _row_check(check_finite, checks.RowCheck(), squeeze),
    )
    if stats:
        out = vocab_pass_with_stats(rows, targets, mask, opts)
        out["logp"] = _poison(out["logp"], invalid)
        return {name: x[0] for name, x in out.items()} if squeeze else out
    if shard is None:
        logp, entropy = vocab_pass(rows, targets, mask, opts)
    else:
        logp, entropy = parallel.vocab_pass(rows, targets, mask, opts, shard)
    logp = _poison(logp, invalid)
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
    checks.check_temperature(temperature)
    checks.check_logit_transform(logit_scale, final_logit_softcapping)
    checks.check_tensor("hidden", hidden)
    squeeze = hidden.dim() == 2
    rows, targets, mask = _rows(hidden, targets, mask, name="hidden")
    backend = resolve_backend(backend, hidden.device)
    stats = checks.check_stats(stats, backend)
    checks.check_linear(rows, weight, bias, backend)
    checks.check_chunk_size(chunk_size)
    tile = checks.check_memory(memory, tile, chunk_size, backend)
    shard = parallel.vocab_shard(process_group, weight.shape[0], vocab_start, stats)
    vocab = weight.shape[0] if shard is None else shard.vocab
    all_rows = _all_rows(check_finite, hidden.device)
    with checks.one_sync(check_finite) as reads:
        mask = _checked_mask(mask, rows, targets, vocab=vocab)
        if not all_rows:
            reads.read(mask.sum())  # the kept-row count sizes the gather: read with the checks
    targets, invalid = _safe_targets(targets, mask, vocab, check_finite)
    kept, row_mask = _kept_rows(mask, None if all_rows else reads.numbers[0])
    memory = _memory_mode(memory, backend, shard, kept, weight, chunk_size, tile)
    opts = FusedLinearOptions(
        backend,
        temperature,
        with_entropy,
        chunk_size,
        logit_scale,
        final_logit_softcapping,
        stats,
        _row_check(check_finite, LINEAR_ROWS, squeeze, kept),
        memory=memory,
        tile=tile,
    )
    if stats:
        out = fused_linear_logprobs_with_stats(
            _take(rows, kept, row_mask), weight, bias, _take(targets, kept, row_mask), opts, row_mask
        )
        out = {name: _scatter(x, kept, mask) for name, x in out.items()}
        out["logp"] = _poison(out["logp"], invalid)
        return {name: x[0] for name, x in out.items()} if squeeze else out
    pass_ = fused_linear_logprobs if shard is None else parallel_linear.on_shard(shard)
    logp_kept, entropy_kept = pass_(
        _take(rows, kept, row_mask), weight, bias, _take(targets, kept, row_mask), opts, row_mask
    )
    logp, entropy = _poison(_scatter(logp_kept, kept, mask), invalid), _scatter(entropy_kept, kept, mask)
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
    checks.check_logits(_layout_view("logits", logits, cu_seqlens), backend)
    shard = parallel.vocab_shard(process_group, logits.shape[-1], vocab_start)
    vocab = logits.shape[-1] if shard is None else shard.vocab
    with checks.one_sync(check_finite):
        inputs = LossInputs.check(
            tuple(logits.shape[:-1]),
            vocab,
            logits.device,
            targets,
            advantages,
            old_logp,
            ref_logp,
            mask,
            is_ratio,
            token_weights,
            sequence_weights,
            cu_seqlens,
            options,
            sampling_logp,
        )
        if check_finite:
            inputs.check_finite(options)
    safe, invalid = _safe_targets(inputs.targets, inputs.mask, vocab, check_finite)
    inputs = dataclasses.replace(inputs, targets=safe, vocab_shard=shard, sequence_group=sequence_group)
    rows = logits if inputs.layout is None else logits[None]  # [R, C, V]
    opts = VocabPassOptions(
        backend,
        options.temperature,
        _needs_entropy(options, with_entropy),
        inplace,
        options.logit_scale,
        options.final_logit_softcapping,
        finite=_row_check(check_finite, checks.RowCheck(), inputs.layout is not None, loss=True),
    )
    in_kernel = _token_level(options, inputs) and options.top_entropy_quantile == 1.0 and options.entropy_coef == 0.0
    in_kernel = in_kernel and (options.beta == 0.0 or options.kl_estimator in FUSED_KL_ESTIMATORS)
    if backend in ("triton", "cuda") and inputs.layout is None and in_kernel and not return_sequence_losses:
        return _fused_grpo_loss(rows, inputs, opts, options, invalid)
    if shard is None:
        logp, entropy = vocab_pass(rows, inputs.targets, inputs.mask, opts)  # [R, C] each
    else:
        logp, entropy = parallel.vocab_pass(rows, inputs.targets, inputs.mask, opts, shard)  # [R, C] each
    return _loss(inputs.terms(_poison(logp, invalid), entropy, options), options, return_sequence_losses)


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
    checks.check_linear(_layout_view("hidden", hidden, cu_seqlens), weight, bias, backend)
    checks.check_chunk_size(chunk_size)
    tile = checks.check_memory(memory, tile, chunk_size, backend)
    shard = parallel.vocab_shard(process_group, weight.shape[0], vocab_start)
    vocab = weight.shape[0] if shard is None else shard.vocab
    all_rows = _all_rows(check_finite, hidden.device)
    with checks.one_sync(check_finite) as reads:
        inputs = LossInputs.check(
            tuple(hidden.shape[:-1]),
            vocab,
            hidden.device,
            targets,
            advantages,
            old_logp,
            ref_logp,
            mask,
            is_ratio,
            token_weights,
            sequence_weights,
            cu_seqlens,
            options,
            sampling_logp,
        )
        if check_finite:
            inputs.check_finite(options)
        if not all_rows:
            reads.read(inputs.mask.sum())  # the kept-row count sizes the gather: read with the checks
    safe, invalid = _safe_targets(inputs.targets, inputs.mask, vocab, check_finite)
    inputs = dataclasses.replace(inputs, targets=safe, vocab_shard=shard, sequence_group=sequence_group)
    rows = hidden if inputs.layout is None else hidden[None]  # [R, C, H]
    kept, row_mask = _kept_rows(inputs.mask, None if all_rows else reads.numbers[0])
    memory = _memory_mode(memory, backend, shard, kept, weight, chunk_size, tile)
    opts = FusedLinearOptions(
        backend,
        options.temperature,
        _needs_entropy(options, with_entropy),
        chunk_size,
        options.logit_scale,
        options.final_logit_softcapping,
        finite=_row_check(check_finite, LINEAR_ROWS, inputs.layout is not None, kept, loss=True),
        memory=memory,
        tile=tile,
    )
    hidden_rows, target_rows = _take(rows, kept, row_mask), _take(inputs.targets, kept, row_mask)  # [M, H], [M]
    fast = memory == "fast" and not return_sequence_losses
    if fast and _token_level(options, inputs) and options.top_entropy_quantile == 1.0:
        chunk_loss = _chunk_loss(inputs, kept, options, row_mask)
        loss, logp, entropy = fused_linear_token_loss(
            hidden_rows, weight, bias, target_rows, opts, chunk_loss, row_mask
        )
        logp = _poison(_scatter(logp, kept, inputs.mask), invalid)
        terms = inputs.terms(logp, _scatter(entropy, kept, inputs.mask), options)
        loss = loss if invalid is None else poisoned(loss, invalid)
        return GRPOLossOutput(loss, loss_metrics(terms, options))
    pass_ = fused_linear_logprobs if shard is None else parallel_linear.on_shard(shard)
    logp, entropy = pass_(hidden_rows, weight, bias, target_rows, opts, row_mask)  # [M] each
    logp = _poison(_scatter(logp, kept, inputs.mask), invalid)
    terms = inputs.terms(logp, _scatter(entropy, kept, inputs.mask), options)
    return _loss(terms, options, return_sequence_losses)


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


def _layout_view(name: str, x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """x as [R, C, ·] rows: itself when padded; packed [N, ·] (with cu_seqlens) as [1, N, ·]."""
    if cu_seqlens is None:
        return x
    if x.dim() != 2:
        raise ValueError(f"with cu_seqlens, {name} must be packed [N, ·], got {list(x.shape)}")
    return x[None]


def _row_check(
    check_finite: bool,
    rows: checks.RowCheck,
    flat: bool,
    kept: tuple[Tensor, Tensor] | None = None,
    loss: bool = False,
) -> checks.RowCheck | None:
    """The vocabulary pass's row check (None: `check_finite=False`), naming a bad row by the user's index: (b, t),
    or n for `[N, ·]` inputs (`flat`), through `kept` when the pass saw only the kept rows. A loss refuses a
    target of probability 0 (logp = -inf)."""
    if not check_finite:
        return None
    if kept is not None:
        position = lambda i: int(kept[1][i]) if flat else (int(kept[0][i]), int(kept[1][i]))  # noqa: E731
    else:
        position = (lambda i: i) if flat else None
    return dataclasses.replace(rows, position=position, zero_prob_ok=not loss)


def _needs_entropy(options: LossOptions, with_entropy: bool) -> bool:
    return with_entropy or options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0


def _rows(x: Tensor, targets: Tensor, mask: Tensor | None, name: str = "logits"):
    """[N, ·] inputs as one row of N tokens: [1, N, ·], targets and mask [1, N]."""
    if x.dim() == 2:
        return x[None], checks.check_tensor("targets", targets)[None], None if mask is None else mask[None]
    if x.dim() != 3:
        raise ValueError(f"{name} must be [B, T, ·] or [N, ·], got {list(x.shape)}")
    return x, targets, mask


def _checked_mask(mask: Tensor | None, rows: Tensor, targets: Tensor, vocab: int | None = None) -> Tensor:
    B, T = rows.shape[:2]
    mask = torch.ones((B, T), dtype=torch.bool, device=rows.device) if mask is None else mask
    checks.check_mask(mask, B, T, rows.device)
    checks.check_targets(targets, mask.bool(), rows.shape[-1] if vocab is None else vocab, rows.device)
    return mask.bool()


def _safe_targets(targets: Tensor, mask: Tensor, vocab: int, check_finite: bool) -> tuple[Tensor, Tensor | None]:
    """Checked targets as they are; unchecked ones (`check_finite=False`) with ids outside [0, V) set to 0, and the
    kept tokens that had one, whose logp becomes NaN (`_poison`): no host sync, no read outside a row."""
    if check_finite:
        return targets, None
    return checks.targets_in_vocab(targets, mask, vocab)


def _poison(logp: Tensor, invalid: Tensor | None) -> Tensor:
    """logp, NaN at the kept tokens whose target was outside [0, V) (unchecked input)."""
    return logp if invalid is None else logp.masked_fill(invalid, float("nan"))


def _all_rows(check_finite: bool, device: torch.device) -> bool:
    """Whether the fused lm_head runs every row, masked, instead of gathering the kept ones: only with the checks
    off inside a CUDA graph capture, where reading the kept-row count (one host sync, batched with the checks') is
    not allowed. Elsewhere that read costs less than the GEMMs on padding rows."""
    return not check_finite and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _kept_rows(mask: Tensor, count: int | None) -> tuple[tuple[Tensor, Tensor], Tensor | None]:
    """((r, c) indices of the rows the fused lm_head runs, in [R, C] order; the mask of those rows [M] or None when
    they are all kept). `count` kept rows are gathered with no further sync; None: every row, masked."""
    if count is None:
        index = torch.arange(mask.numel(), device=mask.device)  # [R·C]
        return (index // mask.shape[1], index % mask.shape[1]), mask.reshape(-1)
    try:
        index = torch.nonzero_static(mask, size=count)  # [M, 2]: the count is known, so no sync
    except NotImplementedError:  # older torch on CUDA
        index = mask.nonzero()
    return (index[:, 0], index[:, 1]), None


def _take(x: Tensor, kept: tuple[Tensor, Tensor], row_mask: Tensor | None) -> Tensor:
    """x [R, C, ·] at the rows `_kept_rows` chose, [M, ·] (every row: a view, no gather)."""
    return x[kept] if row_mask is None else x.flatten(0, 1)


def _scatter(values: Tensor | None, kept: tuple[Tensor, Tensor], mask: Tensor) -> Tensor | None:
    """Kept-token values [M] back into rows [R, C] (0 elsewhere); differentiable."""
    if values is None:
        return None
    return values.new_zeros(mask.shape).index_put(kept, values)


def _loss(terms, options: LossOptions, return_sequence_losses: bool) -> LossResult:
    output, sequence_losses = compute_loss(terms, options)
    return (output, sequence_losses) if return_sequence_losses else output


def _token_level(options: LossOptions, inputs: LossInputs) -> bool:
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


def _omega(inputs: LossInputs, options: LossOptions) -> Tensor:
    """Each token's weight in the padded view: the normaliser's ω times any token / sequence weights, float32."""
    omega = token_weights_for(inputs.padded_mask().float(), POLICY_LOSSES[options.loss_type].normaliser, options)
    if inputs.token_weights is not None:
        omega = omega * inputs.padded(inputs.token_weights).float()  # [B, T]
    if inputs.sequence_weights is not None:
        omega = omega * inputs.sequence_weights.float()[:, None]  # [B, T]
    return omega


def _fused_grpo_loss(
    rows: Tensor, inputs: LossInputs, opts: VocabPassOptions, options: LossOptions, invalid: Tensor | None
):
    """One kernel pass: each token's weighted loss and dL/dlogp come out of the forward kernel's epilogue."""
    epilogue = TokenEpilogue.from_options(POLICY_LOSSES[options.loss_type].epilogue, options)
    adv, is_w = per_sequence_or_token(inputs.advantages), per_sequence_or_token(inputs.is_ratio)  # [B, 1] or [B, T]
    loss, logp, entropy = fused_token_loss(
        rows,
        inputs.targets,
        inputs.mask,
        _omega(inputs, options),
        adv,
        inputs.old_logp,
        inputs.ref_logp,
        is_w,
        opts,
        epilogue,
    )
    if invalid is not None:
        loss, logp = poisoned(loss, invalid), _poison(logp, invalid)
    terms = build_terms(
        logp, inputs.old_logp, inputs.ref_logp, inputs.advantages, inputs.mask, entropy, inputs.is_ratio, options
    )  # for the metrics
    return GRPOLossOutput(loss, loss_metrics(terms, options))


def _chunk_loss(inputs: LossInputs, kept: tuple[Tensor, Tensor], options: LossOptions, row_mask: Tensor | None):
    """A token-level loss as `(rows, logp, entropy) -> that chunk's share of the loss`, for the fused lm_head; the
    rows `row_mask` drops (None: none) are padding to it."""
    omega = inputs.from_padded(_omega(inputs, options), kept)  # [M]
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

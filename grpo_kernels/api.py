"""The public functions: check -> pick backend -> vocabulary pass -> loss algebra -> GRPOLossOutput."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.losses.aggregate import token_weights_for
from grpo_kernels.losses.loss import GRPOLossOutput, compute_loss, loss_metrics
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.losses.terms import build_terms, per_sequence_or_token
from grpo_kernels.options import LossOptions
from grpo_kernels.packing import PackedLayout
from grpo_kernels.vocab.backends import resolve_backend
from grpo_kernels.vocab.function import TokenEpilogue, VocabPassOptions, fused_token_loss, vocab_pass


def _prepare(logits: Tensor, targets: Tensor, mask: Tensor | None, backend: str) -> tuple[str, Tensor, Tensor, Tensor]:
    """Resolve the backend and check logits/targets/mask; returns (backend, logits, targets, bool mask)."""
    checks.check_tensor("logits", logits)
    backend = resolve_backend(backend, logits.device)
    checks.check_logits(logits, backend)
    B, T, V = logits.shape
    if mask is None:
        mask = torch.ones((B, T), dtype=torch.bool, device=logits.device)
    checks.check_mask(mask, B, T, logits.device)
    mask = mask.bool()
    checks.check_targets(targets, mask, V, logits.device)
    return backend, logits, targets.long(), mask


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    mask: Tensor | None = None,
    inplace: bool = True,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each target token under softmax(logits / temperature), and optionally its entropy.

    logits `[B, T, V]` or `[N, V]` (bf16, fp16, fp32), targets `[B, T]` / `[N]`; returns float32 `[B, T]` / `[N]`
    (`(logp, entropy)` with `with_entropy`). Rows where `mask` is 0 are not read and give 0. Differentiable
    w.r.t. logits (through logp and entropy); with `inplace=True` the backward writes the gradient into the
    logits' own buffer (no [N, V] allocation), so the logits' values are gone afterwards.
    """
    checks.check_temperature(temperature)
    packed = isinstance(logits, Tensor) and logits.dim() == 2
    if packed:
        logits = logits.unsqueeze(0)
        targets = targets.unsqueeze(0) if isinstance(targets, Tensor) else targets
        mask = mask.unsqueeze(0) if isinstance(mask, Tensor) else mask
    backend, logits, targets, mask = _prepare(logits, targets, mask, backend)
    opts = VocabPassOptions(backend, temperature, with_entropy, inplace)
    logp, entropy = vocab_pass(logits, targets, mask, opts)
    if packed:
        logp = logp.squeeze(0)
        entropy = None if entropy is None else entropy.squeeze(0)
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
    token_weights: Tensor | None = None,
    sequence_weights: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    return_sequence_losses: bool = False,
    with_entropy: bool = False,
    inplace: bool = True,
    backend: str = "auto",
    options: LossOptions | None = None,
    **loss_options,
) -> GRPOLossOutput | tuple[GRPOLossOutput, Tensor]:
    """GRPO-family loss on logits `[B, T, V]`, with TRL's argument names and semantics.

    targets `[B, T]` (logits[b, t] predicts targets[b, t]), advantages `[B]` or `[B, T]`, old_logp / ref_logp
    `[B, T]` (old_logp None = on-policy), mask `[B, T]` (None = all tokens), is_ratio `[B]` or `[B, T]` (rollout
    importance weight). `token_weights [B, T]` and `sequence_weights [B]` multiply each token's loss (policy and
    KL terms; TR-GRPO, λ-GRPO, DARO), differentiably. Loss options are `LossOptions` fields, as keywords
    (`loss_type="dapo"`, `beta=0.04`, ...) or one `options=LossOptions(...)`. `with_entropy` adds the `entropy`
    metric (computed anyway when `top_entropy_quantile < 1` or `entropy_coef != 0`). The backward writes dL/dlogits
    into the logits buffer unless `inplace=False`.
    Returns `GRPOLossOutput(loss, metrics)`, and with `return_sequence_losses` also each sequence's share of the
    loss `[B]` (before the entropy bonus; differentiable), as `(output, sequence_losses)`.

    Packed layout: with `cu_seqlens` (int `[S + 1]`), logits are `[N, V]`, per-token tensors `[N]`, advantages
    and is_ratio `[S]` or `[N]`, sequence_weights `[S]`; padding never enters the vocabulary pass.
    """
    if options is None:
        options = LossOptions.from_kwargs(**loss_options)
    elif loss_options:
        raise TypeError(
            f"pass loss options either as options=LossOptions(...) or as keywords, not both: {loss_options}"
        )
    if cu_seqlens is not None:
        layout, args = _unpack(
            logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, token_weights, sequence_weights, cu_seqlens
        )
        return _packed_grpo_loss(layout, *args, return_sequence_losses, with_entropy, inplace, backend, options)
    backend, logits, targets, mask = _prepare(logits, targets, mask, backend)
    B, T, _ = logits.shape
    checks.check_loss_inputs(B, T, logits.device, advantages, old_logp, ref_logp, is_ratio, options)
    checks.check_per_token_float("token_weights", token_weights, B, T, logits.device)
    checks.check_per_sequence_float("sequence_weights", sequence_weights, B, logits.device)
    need_entropy = with_entropy or options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0
    opts = VocabPassOptions(backend, options.temperature, need_entropy, inplace)
    weights = (token_weights, sequence_weights)
    if backend == "triton" and _fusable(options, weights) and not return_sequence_losses:
        return _fused_grpo_loss(logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, weights, opts, options)
    logp, entropy = vocab_pass(logits, targets, mask, opts)  # [B, T] each
    terms = build_terms(logp, old_logp, ref_logp, advantages, mask, entropy, is_ratio, options, *weights)
    output, sequence_losses = compute_loss(terms, options)
    return (output, sequence_losses) if return_sequence_losses else output


def _fusable(options: LossOptions, weights: tuple[Tensor | None, Tensor | None]) -> bool:
    """Whether the Triton forward epilogue can form the whole loss: each token's loss depends on that token alone,
    no gradient flows into the entropy or the weights."""
    return (
        POLICY_LOSSES[options.loss_type].epilogue is not None
        and options.importance_sampling_level == "token"
        and options.top_entropy_quantile == 1.0
        and options.entropy_coef == 0.0
        and not any(w is not None and w.requires_grad for w in weights)
    )


def _fused_grpo_loss(
    logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, weights, opts, options
) -> GRPOLossOutput:
    """One Triton pass: each token's weighted loss and dL/dlogp come out of the forward kernel's epilogue."""
    spec = POLICY_LOSSES[options.loss_type]
    omega = token_weights_for(mask.float(), spec.normaliser, options)  # [B, T]
    token_weights, sequence_weights = weights
    if token_weights is not None:
        omega = omega * token_weights.float()  # [B, T]
    if sequence_weights is not None:
        omega = omega * sequence_weights.float()[:, None]  # [B, T]
    epilogue = TokenEpilogue.from_options(spec.epilogue, options)
    adv, is_w = per_sequence_or_token(advantages), per_sequence_or_token(is_ratio)  # [B, 1] or [B, T]
    loss, logp, entropy = fused_token_loss(logits, targets, mask, omega, adv, old_logp, ref_logp, is_w, opts, epilogue)
    terms = build_terms(logp, old_logp, ref_logp, advantages, mask, entropy, is_ratio, options)  # for the metrics
    return GRPOLossOutput(loss, loss_metrics(terms, options))


def _unpack(
    logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, token_weights, sequence_weights, cu_seqlens
):
    """Check the packed inputs ([N, V] logits, [N] / [S] tensors) and index their sequences."""
    checks.check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"with cu_seqlens, logits must be packed [N, V], got {list(logits.shape)}")
    layout = PackedLayout.from_cu_seqlens(cu_seqlens.to(logits.device), logits.shape[0])
    N, S = logits.shape[0], layout.num_sequences
    checks.check_packed("targets", targets, ((N,),), ("[N]",), logits.device, floating=False)
    checks.check_packed("mask", mask, ((N,),), ("[N]",), logits.device, floating=False)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_weights", token_weights)):
        checks.check_packed(name, x, ((N,),), ("[N]",), logits.device)
    for name, x in (("advantages", advantages), ("is_ratio", is_ratio)):
        checks.check_packed(name, x, ((S,), (N,)), ("[S]", "[N]"), logits.device)
    checks.check_packed("sequence_weights", sequence_weights, ((S,),), ("[S]",), logits.device)
    return layout, (logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, token_weights, sequence_weights)


def _packed_grpo_loss(
    layout,
    logits,
    targets,
    advantages,
    old_logp,
    ref_logp,
    mask,
    is_ratio,
    token_weights,
    sequence_weights,
    return_sequence_losses,
    with_entropy,
    inplace,
    backend,
    options,
):
    """The vocabulary pass on the packed rows, then the loss algebra on their [S, T_max] view."""
    backend, logits, targets, mask = _prepare(
        logits[None], targets[None], None if mask is None else mask[None], backend
    )
    need_entropy = with_entropy or options.top_entropy_quantile < 1.0 or options.entropy_coef != 0.0
    logp, entropy = vocab_pass(
        logits, targets, mask, VocabPassOptions(backend, options.temperature, need_entropy, inplace)
    )  # [1, N] each

    def per_token(x: Tensor | None) -> Tensor | None:  # [N] -> [S, T_max]; [S] stays one value per sequence
        return layout.pad(x) if x is not None and x.shape[0] == logp.shape[1] else x

    terms = build_terms(
        layout.pad(logp[0]),
        layout.pad(old_logp),
        layout.pad(ref_logp),
        per_token(advantages),
        layout.pad(mask[0], False),
        None if entropy is None else layout.pad(entropy[0]),
        per_token(is_ratio),
        options,
        layout.pad(token_weights),
        sequence_weights,
    )
    output, sequence_losses = compute_loss(terms, options)
    return (output, sequence_losses) if return_sequence_losses else output

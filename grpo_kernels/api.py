"""The public functions: check -> pick backend -> vocabulary pass -> loss algebra -> GRPOLossOutput."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels import checks
from grpo_kernels.losses.aggregate import NORMALISERS
from grpo_kernels.losses.loss import GRPOLossOutput, compute_loss, loss_metrics
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.losses.terms import build_terms, per_sequence_or_token
from grpo_kernels.options import LossOptions
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
    with_entropy: bool = False,
    inplace: bool = True,
    backend: str = "auto",
    options: LossOptions | None = None,
    **loss_options,
) -> GRPOLossOutput:
    """GRPO-family loss on logits `[B, T, V]`, with TRL's argument names and semantics.

    targets `[B, T]` (logits[b, t] predicts targets[b, t]), advantages `[B]` or `[B, T]`, old_logp / ref_logp
    `[B, T]` (old_logp None = on-policy), mask `[B, T]` (None = all tokens), is_ratio `[B]` or `[B, T]` (rollout
    importance weight). Loss options are `LossOptions` fields, as keywords (`loss_type="dapo"`, `beta=0.04`, ...)
    or one `options=LossOptions(...)`. `with_entropy` adds the `entropy` metric (computed anyway when
    `top_entropy_quantile < 1`). The backward writes dL/dlogits into the logits buffer unless `inplace=False`.
    Returns `GRPOLossOutput(loss, metrics)`.
    """
    if options is None:
        options = LossOptions.from_kwargs(**loss_options)
    elif loss_options:
        raise TypeError(
            f"pass loss options either as options=LossOptions(...) or as keywords, not both: {loss_options}"
        )
    backend, logits, targets, mask = _prepare(logits, targets, mask, backend)
    B, T, _ = logits.shape
    checks.check_loss_inputs(B, T, logits.device, advantages, old_logp, ref_logp, is_ratio, options)
    need_entropy = with_entropy or options.top_entropy_quantile < 1.0
    opts = VocabPassOptions(backend, options.temperature, need_entropy, inplace)
    if backend == "triton" and _token_level(options):
        return _fused_grpo_loss(logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, opts, options)
    logp, entropy = vocab_pass(logits, targets, mask, opts)  # [B, T] each
    terms = build_terms(logp, old_logp, ref_logp, advantages, mask, entropy, is_ratio, options)
    return compute_loss(terms, options)


def _token_level(options: LossOptions) -> bool:
    """Whether each token's loss depends on that token alone and the Triton epilogue implements it."""
    return (
        POLICY_LOSSES[options.loss_type].epilogue is not None
        and options.importance_sampling_level == "token"
        and options.top_entropy_quantile == 1.0
    )


def _fused_grpo_loss(logits, targets, advantages, old_logp, ref_logp, mask, is_ratio, opts, options) -> GRPOLossOutput:
    """One Triton pass: each token's weighted loss and dL/dlogp come out of the forward kernel's epilogue."""
    spec = POLICY_LOSSES[options.loss_type]
    weights = NORMALISERS[spec.normaliser](mask.float(), options)  # [B, T]
    epilogue = TokenEpilogue(
        spec.epilogue,
        options.epsilon_low,
        options.clip_high,
        options.delta,
        options.beta,
        options.sapo_temperature_pos,
        options.sapo_temperature_neg,
        options.use_bias_correction_kl,
    )
    adv, is_w = per_sequence_or_token(advantages), per_sequence_or_token(is_ratio)  # [B, 1] or [B, T]
    loss, logp, entropy = fused_token_loss(
        logits, targets, mask, weights, adv, old_logp, ref_logp, is_w, opts, epilogue
    )
    terms = build_terms(logp, old_logp, ref_logp, advantages, mask, entropy, is_ratio, options)  # for the metrics
    return GRPOLossOutput(loss, loss_metrics(terms, options))

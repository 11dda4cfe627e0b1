"""The autograd Function of the vocabulary pass (logits in); it knows no backend details beyond a name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels.options import LossOptions
from grpo_kernels.vocab import backends, token_logprobs_torch


@dataclass(frozen=True)
class VocabPassOptions:
    """How to run the pass: a concrete backend, temperature, whether to compute entropy, in-place backward."""

    backend: str
    temperature: float = 1.0
    with_entropy: bool = False
    inplace: bool = True


@dataclass(frozen=True)
class TokenEpilogue:
    """A token-level loss for the fused forward: the policy kind (clip, cispo, sapo, gpg) and its hyperparameters."""

    kind: str
    eps_low: float
    eps_high: float
    delta: float | None
    clip_ratio_c: float | None
    cispo_two_sided: bool
    beta: float
    kl_estimator: str
    bias_correction: bool
    tau_pos: float
    tau_neg: float

    @classmethod
    def from_options(cls, kind: str, options: LossOptions) -> TokenEpilogue:
        return cls(
            kind,
            options.epsilon_low,
            options.clip_high,
            options.delta,
            options.clip_ratio_c,
            options.cispo_two_sided,
            options.beta,
            options.kl_estimator,
            options.use_bias_correction_kl,
            options.sapo_temperature_pos,
            options.sapo_temperature_neg,
        )


def _kernels(backend: str):
    if backend == "torch":
        return token_logprobs_torch
    if backend == "triton":
        from grpo_kernels.vocab import token_logprobs_triton  # imported on first use: nothing runs at import

        return token_logprobs_triton
    if backend == "cuda":
        from grpo_kernels.vocab import cuda

        return cuda
    raise ValueError(f"no vocabulary pass for backend {backend!r}")


def _fused_kernels(backend: str):
    """The module with `grpo_loss_fwd` (the vocabulary pass with the token-loss epilogue) for `backend`."""
    if backend == "triton":
        from grpo_kernels.vocab import grpo_loss_triton

        return grpo_loss_triton
    if backend == "cuda":
        from grpo_kernels.vocab import cuda

        return cuda
    raise ValueError(f"no fused token-loss pass for backend {backend!r}")


class _TokenLogprobsFunction(torch.autograd.Function):
    """logits [B, T, V] -> (logp [B, T], entropy [B, T] or empty); saves O(B·T) statistics, never [B, T, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, opts: VocabPassOptions):
        if opts.backend in ("triton", "cuda") and logits.stride(-1) != 1:
            logits = logits.contiguous()
        kernels = _kernels(opts.backend)
        backends.launches[opts.backend] += 1
        logp, lse, entropy = kernels.token_logprobs_fwd(logits, targets, mask, opts.temperature, opts.with_entropy)
        if entropy is None:
            entropy = logp.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, mask, lse, entropy)
        ctx.opts = opts
        ctx.consumed = False
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        opts: VocabPassOptions = ctx.opts
        _consume(ctx)
        logits, targets, mask, lse, entropy = ctx.saved_tensors
        if not opts.with_entropy:
            grad_entropy, entropy = None, None
        out = _in_place_or_new(ctx, logits)
        backends.launches[opts.backend] += 1
        _kernels(opts.backend).token_logprobs_bwd(
            logits, targets, mask, lse, entropy, grad_logp, grad_entropy, opts.temperature, out
        )
        return out, None, None, None


def vocab_pass(logits: Tensor, targets: Tensor, mask: Tensor, opts: VocabPassOptions) -> tuple[Tensor, Tensor | None]:
    """Run the pass on checked [B, T, V] logits; returns logp [B, T] and entropy [B, T] (None if not asked)."""
    logp, entropy = _TokenLogprobsFunction.apply(logits, targets, mask, opts)
    return logp, (entropy if opts.with_entropy else None)


def _consume(ctx) -> None:
    """Refuse a second in-place backward (the first overwrote the saved logits), before touching saved tensors."""
    if ctx.consumed and ctx.opts.inplace:
        raise RuntimeError(
            "the in-place backward already overwrote these logits with their gradient; "
            "pass inplace=False to backpropagate through them more than once"
        )
    ctx.consumed = True


def _in_place_or_new(ctx, logits: Tensor) -> Tensor:
    """The buffer the backward writes dL/dlogits into: the logits themselves unless `inplace=False`."""
    if ctx.opts.inplace:  # triton's forward made the saved logits contiguous in V; torch takes any strides
        torch.autograd.graph.increment_version(logits)  # anything else that saved these logits now errors
        return logits
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


class _FusedTokenLossFunction(torch.autograd.Function):
    """logits [B, T, V] -> (loss, logp [B, T], entropy [B, T] or empty) with the token-level loss formed in the
    forward pass's epilogue; the backward scales the saved dL/dlogp and runs the vocabulary backward."""

    @staticmethod
    def forward(ctx, logits, targets, mask, weights, advantages, old_logp, ref_logp, is_ratio, opts, epilogue):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        backends.launches[opts.backend] += 1
        backends.launches["fused_epilogue"] += 1
        logp, lse, entropy, loss, dlogp = _fused_kernels(opts.backend).grpo_loss_fwd(
            logits,
            targets,
            mask,
            weights,
            advantages,
            old_logp,
            ref_logp,
            is_ratio,
            epilogue,
            opts.temperature,
            opts.with_entropy,
        )
        entropy = logp.new_empty(0) if entropy is None else entropy
        ctx.mark_non_differentiable(logp, entropy)
        ctx.save_for_backward(logits, targets, mask, lse, dlogp)
        ctx.opts = opts
        ctx.consumed = False
        return loss.sum(), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        _consume(ctx)
        logits, targets, mask, lse, dlogp = ctx.saved_tensors
        out = _in_place_or_new(ctx, logits)
        backends.launches[ctx.opts.backend] += 1
        _kernels(ctx.opts.backend).token_logprobs_bwd(
            logits, targets, mask, lse, None, dlogp * grad_loss, None, ctx.opts.temperature, out
        )
        return out, *(None,) * 9


def fused_token_loss(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    weights: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    opts: VocabPassOptions,
    epilogue: TokenEpilogue,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss (0-dim) of a token-level variant in one kernel pass, plus detached logp and entropy [B, T] for metrics.

    weights [B, T] are the normaliser's per-token weights; advantages / is_ratio may be [B, 1] or [B, T].
    """
    B, T = mask.shape
    f32 = lambda x: None if x is None else x.to(torch.float32).contiguous()  # noqa: E731
    expand = lambda x: None if x is None else x.to(torch.float32).expand(B, T)  # noqa: E731
    loss, logp, entropy = _FusedTokenLossFunction.apply(
        logits,
        targets,
        mask,
        f32(weights),
        expand(advantages),
        f32(old_logp),
        f32(ref_logp),
        expand(is_ratio),
        opts,
        epilogue,
    )
    return loss, logp, (entropy if opts.with_entropy else None)

"""The autograd Function of the vocabulary pass (logits in); it knows no backend details beyond a name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels.vocab import backends, token_logprobs_torch


@dataclass(frozen=True)
class VocabPassOptions:
    """How to run the pass: a concrete backend, temperature, whether to compute entropy, in-place backward."""

    backend: str
    temperature: float = 1.0
    with_entropy: bool = False
    inplace: bool = True


def _kernels(backend: str):
    if backend == "torch":
        return token_logprobs_torch
    if backend == "triton":
        from grpo_kernels.vocab import token_logprobs_triton  # imported on first use: nothing runs at import

        return token_logprobs_triton
    raise ValueError(f"no vocabulary pass for backend {backend!r}")


class _TokenLogprobsFunction(torch.autograd.Function):
    """logits [B, T, V] -> (logp [B, T], entropy [B, T] or empty); saves O(B·T) statistics, never [B, T, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, opts: VocabPassOptions):
        if opts.backend == "triton" and logits.stride(-1) != 1:
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
        if ctx.consumed and opts.inplace:
            raise RuntimeError(
                "the in-place backward already overwrote these logits with their gradient; "
                "pass inplace=False to backpropagate through them more than once"
            )
        ctx.consumed = True
        logits, targets, mask, lse, entropy = ctx.saved_tensors
        if not opts.with_entropy:
            grad_entropy, entropy = None, None
        if opts.inplace:  # triton's forward made the saved logits contiguous in V; torch takes any strides
            out = logits
            torch.autograd.graph.increment_version(logits)  # anything else that saved these logits now errors
        else:
            out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        backends.launches[opts.backend] += 1
        _kernels(opts.backend).token_logprobs_bwd(
            logits, targets, mask, lse, entropy, grad_logp, grad_entropy, opts.temperature, out
        )
        return out, None, None, None


def vocab_pass(logits: Tensor, targets: Tensor, mask: Tensor, opts: VocabPassOptions) -> tuple[Tensor, Tensor | None]:
    """Run the pass on checked [B, T, V] logits; returns logp [B, T] and entropy [B, T] (None if not asked)."""
    logp, entropy = _TokenLogprobsFunction.apply(logits, targets, mask, opts)
    return logp, (entropy if opts.with_entropy else None)

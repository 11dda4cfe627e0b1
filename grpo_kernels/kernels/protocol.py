"""The backend protocol: a backend's capability record (`Capabilities`, one per backend subpackage, gathered in
`backend.CAPABILITIES`) and the functions its modules provide. Every tensor is on the logits' device; statistics
are float32 (float64 for float64 logits). `kernels/README.md` walks through adding a backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

VOCAB_PASS = ("token_logprobs_fwd", "token_logprobs_bwd")  # `Capabilities.module`
EPILOGUE = ("grpo_loss_fwd",)  # `Capabilities.epilogue_module`
TILES = ("TileStats", "tile_grad_")  # `Capabilities.tile_module` (the lean fused lm_head)
EPILOGUE_KL = ("k1", "k2", "k3", "low_var_kl")  # the KL estimators a fused epilogue may implement, in kernel order
HALF_AND_SINGLE = (torch.bfloat16, torch.float16, torch.float32)
TOKEN_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # optional outputs of the pass (TRL's names)


def always_usable(device: torch.device) -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Capabilities:
    """What one backend computes, and the modules that compute it (imported on first use). `module` follows the
    protocol below: `token_logprobs_fwd` / `token_logprobs_bwd`; `epilogue_module` adds
    `grpo_loss_fwd` (a token-level loss formed in the forward kernel's epilogue), `tile_module` the lean fused
    lm_head's `TileStats` / `tile_grad_`."""

    name: str
    module: str
    dtypes: tuple[torch.dtype, ...]  # of the logits / hidden states it computes on
    usable: Callable[[torch.device], tuple[bool, str]] = always_usable  # (ok, why not) on a device
    stats: bool = False  # the extra per-token statistics (`TOKEN_STATS`)
    contiguous_vocab: bool = False  # reads logits with stride 1 along V (others are copied first)
    epilogue_module: str | None = None
    epilogue_kl: tuple[str, ...] = ()  # the KL estimators its epilogue implements
    epilogue_needs_grad: bool = False  # its epilogue pays only when a gradient is taken (else the two-phase route)
    tile_module: str | None = None
    before_import: Callable[[], None] | None = None  # a check to run before its modules are imported


@functools.cache
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a pass over logits or hidden states of `dtype` computes in: float32 for bf16/fp16/fp32, float64 for
    float64 (cached: it runs on every call)."""
    return torch.promote_types(dtype, torch.float32)


def writes_in_place(out: Tensor, logits: Tensor) -> bool:
    """Whether a backward told to write into `out` overwrites the logits (the in-place backward, whose op declares
    the logits mutated): `out` is the logits, or, in eager mode, starts at their address. Under torch.compile only
    the first is known (fake tensors have no address); another view of them as `out` then takes the op that
    declares `out` mutated, with the same result."""
    return out is logits or (not torch.compiler.is_compiling() and out.data_ptr() == logits.data_ptr())


@dataclass(frozen=True, kw_only=True)
class VocabPassArgs:
    """What every backend's vocabulary pass reads, one record for all of them: logits [B, T, V] (rows of a chunk of
    the fused lm_head come as [1, c, V]), targets [B, T] ids, mask [B, T] bool (masked rows give 0 and are never read
    for their target); the transform z = c·tanh(s·x/c) / temperature (s `logit_scale`, c `softcap`, None: no cap);
    whether the forward computes the entropy, and which of `TOKEN_STATS` it adds (the backward reads neither). A
    pass's fields besides its tensors are formed once per call (`pass_options.PassOptions.pass_fields`)."""

    logits: Tensor
    targets: Tensor
    mask: Tensor
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    with_entropy: bool = False
    stats: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RowGrads:
    """What a backward reads per row besides the pass's record, [B, T] each (a window's: [C]): the forward's lse,
    and the entropy and upstream gradients dL/dlogp, dL/dH (None where not taken; the entropy is read only with
    dL/dH)."""

    lse: Tensor
    entropy: Tensor | None = None
    grad_logp: Tensor | None = None
    grad_entropy: Tensor | None = None

    def at(self, rows: slice | int | None) -> RowGrads:
        """The record of `rows` of these rows (an index of the rows along the first dimension; None adds one)."""
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        return dataclasses.replace(self, **{field: pick(getattr(self, field)) for field in self.__dataclass_fields__})


@dataclass(frozen=True)
class LossSides:
    """A token-level loss's tensors besides the logits, which the backends' `grpo_loss_fwd` reads, in the order the
    compiled ops take them: weights [B, T] (the normaliser's per-token weights), advantages [B, 1] or [B, T],
    old_logp / ref_logp [B, T] and is_ratio [B, 1] or [B, T] (None: not used)."""

    weights: Tensor
    advantages: Tensor
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    is_ratio: Tensor | None = None


def epilogue_fields(epilogue) -> tuple:
    """A `losses.epilogue.TokenEpilogue`'s fields as the compiled ops take them (their schemas have no records):
    kind, eps_low, eps_high, delta, clip_ratio_c, cispo_two_sided, beta, kl_estimator, bias_correction, tau_pos,
    tau_neg, each as a plain Python value."""
    optional = lambda x: None if x is None else float(x)  # noqa: E731
    return (
        epilogue.kind, float(epilogue.eps_low), float(epilogue.eps_high), optional(epilogue.delta),
        optional(epilogue.clip_ratio_c), bool(epilogue.cispo_two_sided), float(epilogue.beta), epilogue.kl_estimator,
        bool(epilogue.bias_correction), float(epilogue.tau_pos), float(epilogue.tau_neg),
    )  # fmt: skip


class VocabPass(Protocol):
    """`Capabilities.module`: the vocabulary pass, over `VocabPassArgs`."""

    def token_logprobs_fwd(self, args: VocabPassArgs) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
        """logp, lse, entropy (None unless asked) [B, T] of z, and each asked statistic by name (only with
        `Capabilities.stats`)."""

    def token_logprobs_bwd(self, args: VocabPassArgs, grads: RowGrads, out: Tensor) -> None:
        """Write dL/dlogits into `out` (which may be the logits themselves): per kept row
        (g·(onehot − q) − g_H·q·(log q + H))·dz/dx, masked rows 0."""


class Epilogue(Protocol):
    """`Capabilities.epilogue_module`: the forward pass with a token-level loss formed in its epilogue."""

    def grpo_loss_fwd(self, args: VocabPassArgs, sides: LossSides, epilogue
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:  # fmt: skip
        """logp, lse, entropy|None, each token's weighted loss and weighted dL/dlogp, [B, T] float32, 0 at masked
        rows; the sides in the compute dtype, advantages / is_ratio as [B, T] views. `epilogue` is the loss's plain
        record (`losses.epilogue.TokenEpilogue`: kind, clip widths, KL estimator among `Capabilities.epilogue_kl`,
        ...)."""

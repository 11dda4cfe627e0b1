"""A loss call's per-token and per-sequence tensors: as passed (`LossTensors`), and checked once (`LossInputs`).

Padded: targets/mask/old/ref/token_weights `[B, T]`, advantages/is_ratio `[B]` or `[B, T]`, sequence_weights `[B]`.
Packed (`cu_seqlens`): the same per token as `[N]`, per sequence as `[S]`. The vocabulary pass sees `rows` of
shape `[R, C]` (`[B, T]`, or `[1, N]` packed); the loss algebra sees the padded `[B, T]` (or `[S, T_max]`) view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.engine import finite, sync, validate
from grpo_kernels.engine.layout import safe_targets
from grpo_kernels.losses.terms import TokenTerms, build_terms
from grpo_kernels.options import LossOptions
from grpo_kernels.packing import PackedLayout


class NamedRecord:
    """A record built from a call's named arguments (`locals()` of a public function): each field takes the argument
    of the same name; absent ones keep their defaults."""

    @classmethod
    def named(cls, arguments: dict[str, Any]):
        return cls(**{name: arguments[name] for name in cls.__dataclass_fields__ if name in arguments})


@dataclass(frozen=True)
class LossTensors(NamedRecord):
    """The tensors of a loss call as the caller passed them, by name (unchecked)."""

    targets: Tensor
    advantages: Tensor
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    mask: Tensor | None = None
    is_ratio: Tensor | None = None
    sampling_logp: Tensor | None = None
    token_weights: Tensor | None = None
    sequence_weights: Tensor | None = None
    cu_seqlens: Tensor | None = None


@dataclass(frozen=True)
class LossInputs:
    targets: Tensor  # [R, C] int64, the vocabulary pass's rows; unchecked ids outside [0, V) set to 0
    mask: Tensor  # [R, C] bool
    advantages: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None
    is_ratio: Tensor | None
    token_weights: Tensor | None
    sequence_weights: Tensor | None
    layout: PackedLayout | None  # None: padded
    sampling_logp: Tensor | None = None  # the sampler's log-probs, for the off-policy sequence mask
    invalid: Tensor | None = None  # [R, C] kept tokens whose (unchecked) target was outside [0, V): logp NaN
    sequence_group: Any = None  # the process group the sequences are split across (context parallel)

    @classmethod
    def check(
        cls,
        given: LossTensors,
        *,
        leading: tuple[int, ...],
        vocab: int,
        device: torch.device,
        options: LossOptions,
        check_finite: bool,
        sequence_group: Any = None,
    ) -> LossInputs:
        """Check everything against the leading dims of logits/hidden (`(B, T)`, or `(N,)` with cu_seqlens), and
        with `check_finite` for non-finite values at kept tokens; value checks are read by the caller's
        `sync.one_sync`. Unchecked targets are made safe to index with (`layout.safe_targets`)."""
        if given.cu_seqlens is None:
            mask, layout = _check_padded(given, leading, vocab, device, options), None
        else:
            mask, layout = _check_packed(given, leading, vocab, device, options)
        targets = given.targets.long() if layout is None else given.targets.long()[None]
        targets, invalid = safe_targets(targets, mask, vocab, check_finite)
        keep = _sequence_kept(mask, layout)  # [B] / [S]
        per_token = lambda x: layout is not None and x is not None and x.shape[0] == mask.shape[1]  # noqa: E731  [N]
        inputs = cls(
            targets=targets,
            mask=mask,
            advantages=given.advantages if per_token(given.advantages) else _neutral(given.advantages, keep, 0.0),
            old_logp=given.old_logp,
            ref_logp=given.ref_logp,
            is_ratio=given.is_ratio if per_token(given.is_ratio) else _neutral(given.is_ratio, keep, 1.0),
            token_weights=given.token_weights,
            sequence_weights=_neutral(given.sequence_weights, keep, 0.0),
            layout=layout,
            sampling_logp=given.sampling_logp,
            invalid=invalid,
            sequence_group=sequence_group,
        )
        if check_finite:
            inputs.check_finite(options, keep)
        return inputs

    def check_finite(self, options: LossOptions, sequence_kept: Tensor) -> None:
        """ValueError naming the first tensor with NaN or ±inf at a kept token (a per-sequence one: at a sequence
        with a kept token), and its index; padding may hold anything. One host sync (`check_finite=True`).
        sampling_logp may hold NaN: TRL's mark of a token the sampler could not score (no off-policy evidence).

        Padded inputs queue one flag for all of them (`finite.any_nonfinite_at_kept`); its error path names the
        tensor with the exact per-tensor checks."""
        mask = self.mask if self.layout is None else self.mask[0]
        names = ("advantages", "old_logp", "ref_logp", "sampling_logp", "is_ratio", "token_weights", "sequence_weights")

        def kept(name: str, x: Tensor) -> Tensor:
            if name == "sampling_logp":  # NaN: a token the sampler could not score
                return mask & ~torch.isnan(x)
            return mask if x.shape == mask.shape else sequence_kept

        given = [(name, x) for name in names if (x := getattr(self, name)) is not None]
        blame = lambda: finite.check_finite_at_kept([(name, x, kept(name, x)) for name, x in given])  # noqa: E731
        if self.layout is None:  # a per-sequence [B] value counts at its row's kept tokens
            finite.any_nonfinite_at_kept(given, mask, blame, nan_ok="sampling_logp")
        else:
            blame()
        for name in ("num_items_in_batch", "num_sequences_in_batch"):  # normalisers: finite, > 0
            value = getattr(options, name, None)
            if isinstance(value, Tensor):
                flat = value.reshape(-1)
                finite.check_finite_at_kept([(name, flat, torch.ones_like(flat, dtype=torch.bool))])
                sync.check_positive_count(name, value)
            elif value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")

    def terms(self, logp: Tensor, entropy: Tensor | None, options: LossOptions) -> TokenTerms:
        """TokenTerms of the loss algebra from the pass's logp / entropy [R, C], in the padded view."""
        if self.layout is None:
            pad, per_token, mask = (lambda x, fill=0: x), (lambda x: x), self.mask  # noqa: E731
        else:
            pad, n = self.layout.pad, logp.shape[1]
            per_token = lambda x: pad(x) if x is not None and x.shape[0] == n else x  # noqa: E731  [N] -> [S, T_max]
            logp, entropy, mask = logp[0], None if entropy is None else entropy[0], pad(self.mask[0], False)
        return build_terms(
            logp=pad(logp),
            old_logp=pad(self.old_logp),
            ref_logp=pad(self.ref_logp),
            advantages=per_token(self.advantages),
            mask=mask,
            entropy=pad(entropy),
            is_ratio=per_token(self.is_ratio),
            options=options,
            token_weights=pad(self.token_weights),
            sequence_weights=self.sequence_weights,
            sampling_logp=pad(self.sampling_logp),
            sequence_group=self.sequence_group,
        )

    def per_kept_token(self, x: Tensor | None, kept: tuple[Tensor, Tensor]) -> Tensor | None:
        """A per-token ([R, C] / [N]) or per-sequence ([B] / [S]) tensor as one value per kept token, [M]."""
        if x is None:
            return None
        r, c = kept
        if self.layout is None:
            return x[r, c] if x.dim() == 2 else x[r]
        return x[c] if x.shape[0] == self.mask.shape[1] else x[self.layout.sequence[c]]

    def padded_mask(self) -> Tensor:
        """The mask in the loss algebra's padded view, [B, T] or [S, T_max]."""
        return self.mask if self.layout is None else self.layout.pad(self.mask[0], False)

    def padded(self, x: Tensor) -> Tensor:
        """A per-token tensor ([B, T] / [N]) in the padded view."""
        return x if self.layout is None else self.layout.pad(x)

    def from_padded(self, x: Tensor, kept: tuple[Tensor, Tensor]) -> Tensor:
        """A padded-view tensor [B, T] / [S, T_max] at the kept tokens, [M]."""
        r, c = kept
        return x[r, c] if self.layout is None else x[self.layout.sequence[c], self.layout.position[c]]


def _check_padded(given: LossTensors, leading: tuple[int, ...], vocab: int, device, options: LossOptions) -> Tensor:
    """The padded layout's checks; returns the mask [B, T] bool."""
    if len(leading) != 2:
        raise ValueError(f"expected [B, T, ·] logits or hidden states, got leading dims {list(leading)}")
    B, T = leading
    mask = torch.ones((B, T), dtype=torch.bool, device=device) if given.mask is None else given.mask
    validate.check_mask(mask, B, T, device)
    validate.check_targets(given.targets, mask.bool(), vocab, device)
    validate.check_loss_inputs(given, B=B, T=T, device=device, options=options)
    validate.check_per_token_float("token_weights", given.token_weights, B, T, device)
    validate.check_per_sequence_float("sequence_weights", given.sequence_weights, B, device)
    _check_ref_logp(given, options)
    return mask.bool()


def _check_packed(
    given: LossTensors, leading: tuple[int, ...], vocab: int, device, options: LossOptions
) -> tuple[Tensor, PackedLayout]:
    """The packed layout's checks (`cu_seqlens`); returns the mask [1, N] bool and the layout."""
    if len(leading) != 1:
        raise ValueError(f"with cu_seqlens, expected packed [N, ·] logits or hidden states, got {list(leading)}")
    (N,) = leading
    layout = PackedLayout.from_cu_seqlens(given.cu_seqlens.to(device), N)
    S = layout.num_sequences
    mask = torch.ones(N, dtype=torch.bool, device=device) if given.mask is None else given.mask
    validate.check_packed("targets", given.targets, ((N,),), ("[N]",), device, floating=False)
    validate.check_packed("mask", mask, ((N,),), ("[N]",), device, floating=False)
    validate.check_mask(mask[None], 1, N, device)
    validate.check_targets(given.targets[None], mask[None].bool(), vocab, device)
    for name in ("old_logp", "ref_logp", "sampling_logp", "token_weights"):
        validate.check_packed(name, getattr(given, name), ((N,),), ("[N]",), device)
    for name in ("advantages", "is_ratio"):
        validate.check_packed(name, getattr(given, name), ((S,), (N,)), ("[S]", "[N]"), device)
    validate.check_packed("sequence_weights", given.sequence_weights, ((S,),), ("[S]",), device)
    _check_ref_logp(given, options)
    return mask.bool()[None], layout


def _check_ref_logp(given: LossTensors, options: LossOptions) -> None:
    if options.beta != 0.0 and given.ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={options.beta})")


def _sequence_kept(mask: Tensor, layout: PackedLayout | None) -> Tensor:
    """Whether each sequence has a kept token, [B] / [S]."""
    if layout is None:
        return mask.any(1)  # [B]
    kept = torch.zeros(layout.num_sequences, dtype=torch.bool, device=mask.device)
    return kept.index_fill_(0, layout.sequence[mask[0]], True)  # [S]


def _neutral(x: Tensor | None, keep: Tensor, fill: float) -> Tensor | None:
    """A per-sequence x [B] / [S] with its non-finite values at sequences without a kept token as `fill` (advantage
    0, IS weight 1, weight 0): they are padding, which may hold anything (NaN included) and would reach the loss as
    0 · NaN. (Finite ones stay: TRL's per-sequence metrics average over every sequence.) Other shapes pass."""
    if x is None or x.dim() != 1:
        return x  # per-token values: build_terms neutralises their padding
    return torch.where(keep, x, x.nan_to_num(nan=fill, posinf=fill, neginf=fill))

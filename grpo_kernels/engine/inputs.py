"""A call's tensors: as passed (`TokenTensors` for a log-prob call, `LossTensors` for a loss call), and a loss call's
checked once (`LossInputs`), in its `Layout` (`engine/layout.py`).

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
from grpo_kernels.engine.layout import Layout
from grpo_kernels.losses.terms import TokenTerms, build_terms
from grpo_kernels.options import LossOptions


class NamedRecord:
    """A record built from a call's named arguments (`locals()` of a public function): each field takes the argument
    of the same name; absent ones keep their defaults."""

    @classmethod
    def named(cls, arguments: dict[str, Any]):
        return cls(**{name: arguments[name] for name in cls.__dataclass_fields__ if name in arguments})


@dataclass(frozen=True)
class TokenTensors(NamedRecord):
    """The per-token tensors every call has, as the caller passed them (unchecked)."""

    targets: Tensor
    mask: Tensor | None = None
    cu_seqlens: Tensor | None = None
    sampling_mask: Any = None  # the sampler's kept tokens (`engine.replay`)


@dataclass(frozen=True)
class LossTensors(TokenTensors):
    """The tensors of a loss call as the caller passed them, by name (unchecked)."""

    advantages: Tensor | None = None  # required: the argument checks refuse None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    is_ratio: Tensor | None = None
    sampling_logp: Tensor | None = None
    token_weights: Tensor | None = None
    sequence_weights: Tensor | None = None


@dataclass(frozen=True)
class LossInputs:
    """A loss call's tensors, checked: the mask as the pass's `[R, C]` rows, the others in the user's shapes."""

    layout: Layout
    mask: Tensor  # [R, C] bool
    advantages: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None
    is_ratio: Tensor | None
    token_weights: Tensor | None
    sequence_weights: Tensor | None
    sampling_logp: Tensor | None = None  # the sampler's log-probs, for the off-policy sequence mask
    sequence_group: Any = None  # the process group the sequences are split across (context parallel)

    @classmethod
    def check(
        cls,
        given: LossTensors,
        *,
        layout: Layout,
        mask: Tensor,
        device: torch.device,
        options: LossOptions,
        check_finite: bool,
        sequence_group: Any = None,
    ) -> LossInputs:
        """Check the tensors besides targets and mask (checked with the layout: `Layout.checked_tokens`) against the
        layout, and with `check_finite` for non-finite values at kept tokens; value checks are read by the caller's
        `sync.one_sync`."""
        token, sequence = layout.side_shapes()
        validate.check_side_inputs(given, token=token, sequence=sequence, device=device, options=options)
        keep = layout.sequence_kept(mask)  # [B] / [S]
        per_sequence = lambda x: x is not None and tuple(x.shape) != token[0]  # noqa: E731
        inputs = cls(
            layout=layout,
            mask=mask,
            advantages=_neutral(given.advantages, keep, 0.0) if per_sequence(given.advantages) else given.advantages,
            old_logp=given.old_logp,
            ref_logp=given.ref_logp,
            is_ratio=_neutral(given.is_ratio, keep, 1.0) if per_sequence(given.is_ratio) else given.is_ratio,
            token_weights=given.token_weights,
            sequence_weights=_neutral(given.sequence_weights, keep, 0.0),
            sampling_logp=given.sampling_logp,
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
        mask = self.layout.from_rows(self.mask)
        names = ("advantages", "old_logp", "ref_logp", "sampling_logp", "is_ratio", "token_weights", "sequence_weights")

        def kept(name: str, x: Tensor) -> Tensor:
            if name == "sampling_logp":  # NaN: a token the sampler could not score
                return mask & ~torch.isnan(x)
            return mask if x.shape == mask.shape else sequence_kept

        given = [(name, x) for name in names if (x := getattr(self, name)) is not None]
        blame = lambda: finite.check_finite_at_kept([(name, x, kept(name, x)) for name, x in given])  # noqa: E731
        if self.layout.packed is None:  # a per-sequence [B] value counts at its row's kept tokens
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
        """TokenTerms of the loss algebra from the pass's logp / entropy [R, C], in the padded view: the one way
        every route builds them."""
        names = ("old_logp", "ref_logp", "advantages", "is_ratio", "token_weights", "sampling_logp")
        views = self.layout.padded_views(
            rows={"logp": logp, "entropy": entropy, "mask": self.mask}, given={n: getattr(self, n) for n in names}
        )
        return build_terms(
            **views, options=options, sequence_weights=self.sequence_weights, sequence_group=self.sequence_group
        )

    def padded_mask(self) -> Tensor:
        """The mask in the loss algebra's padded view, [B, T] or [S, T_max]."""
        return self.layout.padded_rows(self.mask, False)


def _neutral(x: Tensor | None, keep: Tensor, fill: float) -> Tensor | None:
    """A per-sequence x [B] / [S] with its non-finite values at sequences without a kept token as `fill` (advantage
    0, IS weight 1, weight 0): they are padding, which may hold anything (NaN included) and would reach the loss as
    0 · NaN. (Finite ones stay: TRL's per-sequence metrics average over every sequence.) Other shapes pass."""
    if x is None or x.dim() != 1:
        return x  # per-token values: build_terms neutralises their padding
    return torch.where(keep, x, x.nan_to_num(nan=fill, posinf=fill, neginf=fill))

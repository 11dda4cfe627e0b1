"""A call's tensors: as passed (`TokenTensors` for a log-prob call, `LossTensors` for a loss call), and a loss call's
checked once (`LossInputs`), in its `Layout` (`engine/layout.py`).

Padded: targets/mask/old/ref/token_weights `[B, T]`, advantages/is_ratio `[B]` or `[B, T]`, sequence_weights `[B]`.
Packed (`cu_seqlens`): the same per token as `[N]`, per sequence as `[S]`. The vocabulary pass sees `rows` of
shape `[R, C]` (`[B, T]`, or `[1, N]` packed); the loss algebra sees the padded `[B, T]` (or `[S, T_max]`) view.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.engine import finite
from grpo_kernels.engine.layout import Layout
from grpo_kernels.engine.sync import ValueCheck
from grpo_kernels.losses.mismatch import apply_rollout_correction
from grpo_kernels.losses.sampler_ratio import SamplerCorrection
from grpo_kernels.losses.terms import TokenTerms, build_terms
from grpo_kernels.options import LossOptions


@dataclass(frozen=True)
class TokenTensors:
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
    sampler_correction: SamplerCorrection | None = None  # is_ratio formed from π_old and sampling_logp


@dataclass(frozen=True)
class LossInputs:
    """A loss call's tensors, checked, in the loss algebra's padded view (`[B, T]`, packed `[S, T_max]`); per-sequence
    ones `[B]` / `[S]`."""

    layout: Layout
    mask: Tensor  # padded view, bool
    advantages: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None
    is_ratio: Tensor | None
    token_weights: Tensor | None
    sequence_weights: Tensor | None
    sampling_logp: Tensor | None = None  # the sampler's log-probs, for the off-policy sequence mask
    sequence_group: Any = None  # the process group the sequences are split across (context parallel)
    correction_metrics: dict[str, Tensor] | None = None  # the rollout correction's, when formed from the inputs
    sampler_correction: SamplerCorrection | None = None  # TRL's, formed from π_old
    ratio_reads_pass: bool = False  # the sampler correction's π_old is the pass's own log-probs (old_logp None: π_θ
    # at the update), so its IS weight is formed from them (`own_is_ratio`)

    @classmethod
    def of(
        cls,
        given: LossTensors,
        layout: Layout,
        options: LossOptions,
        *,
        check_finite: bool,
        sequence_group: Any = None,
    ) -> tuple[LossInputs, list[ValueCheck]]:
        """The tensors `given` (their shapes checked: `validate.check_call`) in the padded view of `layout`, under
        `options.rollout_correction` where it reads the inputs alone (`corrected`), and with `check_finite` the checks
        of their values at kept tokens, to be read with the call's one host sync."""
        keep, token = layout.sequence_kept, layout.leading  # [B] / [S]; the per-token shape
        per_sequence = lambda x: x is not None and tuple(x.shape) != token  # noqa: E731
        advantages = _neutral(given.advantages, keep, 0.0) if per_sequence(given.advantages) else given.advantages
        is_ratio = _neutral(given.is_ratio, keep, 1.0) if per_sequence(given.is_ratio) else given.is_ratio
        named = {
            "advantages": advantages,
            "old_logp": given.old_logp,
            "ref_logp": given.ref_logp,
            "sampling_logp": given.sampling_logp,
            "is_ratio": is_ratio,
            "token_weights": given.token_weights,
            "sequence_weights": _neutral(given.sequence_weights, keep, 0.0),
        }
        checks = []
        if check_finite:
            given_ones = [(name, x) for name, x in named.items() if x is not None]
            user_mask = layout.mask[0] if layout.flat else layout.mask  # [B, T] / [N]
            checks = finite.input_checks(given_ones, user_mask, keep, packed=layout.padded_index is not None)
        view = {name: x if per_sequence(x) or x is None else padded(layout, x) for name, x in named.items()}
        inputs = cls(
            layout=layout,
            mask=padded(layout, layout.mask, False),
            sequence_group=sequence_group,
            sampler_correction=given.sampler_correction,
            ratio_reads_pass=given.sampler_correction is not None and given.old_logp is None,
            **view,
        )
        return inputs.corrected(options), checks

    def corrected(self, options: LossOptions) -> LossInputs:
        """These inputs under `options.rollout_correction` (`losses.mismatch`): under bypass π_old is the sampler's;
        a correction of the inputs alone (decoupled, no IPO or squared-log term) is formed here, before the pass, so
        that every route, fused ones included, takes its IS weight and rejected mask as given inputs. The sampler
        correction of a given π_old is formed here too."""
        if self.sampler_correction is not None and self.old_logp is not None:
            return dataclasses.replace(self, is_ratio=self.sampler_ratio(self.old_logp))
        correction = options.rollout_correction
        if correction is None:
            return self
        if correction.bypass_mode:
            return dataclasses.replace(self, old_logp=self.sampling_logp)
        return self if correction.reads_policy_logp else self.with_correction(options, None)

    def with_correction(self, options: LossOptions, logp: Tensor | None) -> LossInputs:
        """The rollout correction applied: its IS weight as `is_ratio`, its rejection removed from the mask, its
        metrics kept; `logp` [B, T] (padded view): the policy's, when the correction reads it."""
        old_logp, weights, mask, metrics = apply_rollout_correction(
            options.rollout_correction, self.old_logp, self.sampling_logp, self.mask, logp
        )
        return dataclasses.replace(self, old_logp=old_logp, mask=mask, is_ratio=weights, correction_metrics=metrics)

    def own_is_ratio(self, logp: Tensor, at: tuple[Tensor, Tensor]) -> Tensor:
        """The sampler correction's IS weight, [B, T] or [B], with π_old := `logp` [c] (the pass's, detached) at the
        padded-view positions `at` and 0 elsewhere: a token mode's weight at `at`, a sequence mode's for the
        sequences `at` holds whole."""
        old = torch.zeros(self.mask.shape, dtype=logp.dtype, device=logp.device).index_put(at, logp.detach())
        return self.sampler_ratio(old)

    def with_own_old_logp(self, logp: Tensor) -> LossInputs:
        """These inputs with π_old := the pass's log-probs `logp` [R, C] (a no-grad pass's) and the sampler
        correction's IS weight formed from them."""
        old_logp = padded(self.layout, logp)
        return dataclasses.replace(
            self, old_logp=old_logp, is_ratio=self.sampler_ratio(old_logp), ratio_reads_pass=False
        )

    def sampler_ratio(self, old_logp: Tensor) -> Tensor:
        """The sampler correction's IS weight, [B, T] or [B], of π_old `old_logp` [B, T] (padded view)."""
        return self.sampler_correction.ratio(old_logp, self.sampling_logp, self.mask)

    def terms(self, logp: Tensor, entropy: Tensor | None, options: LossOptions) -> TokenTerms:
        """TokenTerms of the loss algebra from the pass's logp / entropy [R, C], in the padded view: the one way
        every route builds them (a correction that reads the policy's log-probs is formed here)."""
        logp = padded(self.layout, logp)
        correction = options.rollout_correction
        inputs = self.with_correction(options, logp) if correction and correction.reads_policy_logp else self
        if self.ratio_reads_pass:  # π_old is this pass's logp (0 at padding, as a π_old pass gives it)
            inputs = dataclasses.replace(inputs, is_ratio=self.sampler_ratio(logp.detach()))
        return build_terms(
            logp,
            entropy=None if entropy is None else padded(self.layout, entropy),
            mask=inputs.mask,
            old_logp=inputs.old_logp,
            ref_logp=inputs.ref_logp,
            advantages=inputs.advantages,
            is_ratio=inputs.is_ratio,
            token_weights=inputs.token_weights,
            sampling_logp=inputs.sampling_logp,
            options=options,
            sequence_weights=inputs.sequence_weights,
            sequence_group=inputs.sequence_group,
            correction_metrics=inputs.correction_metrics,
        )


def padded(layout: Layout, x: Tensor, fill: float | bool = 0) -> Tensor:
    """A per-token tensor, the user's `[B, T]` / `[N]` or the pass's `[R, C]`, in the padded view `[B, T]` /
    `[S, T_max]` (packed: `fill` where a sequence is shorter); differentiable."""
    if layout.padded_index is None:
        return x
    return x.new_full(layout.padded_shape, fill).index_put(layout.padded_index, x.reshape(-1))  # [S, T_max]


def _neutral(x: Tensor | None, keep: Tensor, fill: float) -> Tensor | None:
    """A per-sequence x [B] / [S] with its non-finite values at sequences without a kept token as `fill` (advantage
    0, IS weight 1, weight 0): they are padding, which may hold anything (NaN included) and would reach the loss as
    0 · NaN. (Finite ones stay: TRL's per-sequence metrics average over every sequence.) Other shapes pass."""
    if x is None or x.dim() != 1:
        return x  # per-token values: build_terms neutralises their padding
    return torch.where(keep, x, x.nan_to_num(nan=fill, posinf=fill, neginf=fill))

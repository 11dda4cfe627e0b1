"""LossInputs: a loss call's per-token and per-sequence tensors, checked once, in either layout.

Padded: targets/mask/old/ref/token_weights `[B, T]`, advantages/is_ratio `[B]` or `[B, T]`, sequence_weights `[B]`.
Packed (`cu_seqlens`): the same per token as `[N]`, per sequence as `[S]`. The vocabulary pass sees `rows` of
shape `[R, C]` (`[B, T]`, or `[1, N]` packed); the loss algebra sees the padded `[B, T]` (or `[S, T_max]`) view.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.engine import finite, validate
from grpo_kernels.losses.terms import TokenTerms, build_terms
from grpo_kernels.options import LossOptions
from grpo_kernels.packing import PackedLayout


@dataclass(frozen=True)
class LossInputs:
    targets: Tensor  # [R, C] int64, the vocabulary pass's rows
    mask: Tensor  # [R, C] bool
    advantages: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None
    is_ratio: Tensor | None
    token_weights: Tensor | None
    sequence_weights: Tensor | None
    layout: PackedLayout | None  # None: padded
    sampling_logp: Tensor | None = None  # the sampler's log-probs, for the off-policy sequence mask
    vocab_shard: Any = None  # kernels.parallel.VocabShard: the pass sees this rank's vocabulary shard
    sequence_group: Any = None  # the process group the sequences are split across (context parallel)

    @classmethod
    def check(
        cls,
        leading: tuple[int, ...],
        vocab: int,
        device,
        targets,
        advantages,
        old_logp,
        ref_logp,
        mask,
        is_ratio,
        token_weights,
        sequence_weights,
        cu_seqlens,
        options: LossOptions,
        sampling_logp: Tensor | None = None,
    ) -> LossInputs:
        """Check everything against the leading dims of logits/hidden (`(B, T)`, or `(N,)` with cu_seqlens)."""
        if cu_seqlens is None:
            if len(leading) != 2:
                raise ValueError(f"expected [B, T, ·] logits or hidden states, got leading dims {list(leading)}")
            B, T = leading
            mask = torch.ones((B, T), dtype=torch.bool, device=device) if mask is None else mask
            validate.check_mask(mask, B, T, device)
            validate.check_targets(targets, mask.bool(), vocab, device)
            validate.check_loss_inputs(B, T, device, advantages, old_logp, ref_logp, is_ratio, options, sampling_logp)
            validate.check_per_token_float("token_weights", token_weights, B, T, device)
            validate.check_per_sequence_float("sequence_weights", sequence_weights, B, device)
            return cls(
                targets.long(),
                mask.bool(),
                advantages,
                old_logp,
                ref_logp,
                is_ratio,
                token_weights,
                sequence_weights,
                None,
                sampling_logp,
            )._neutral_empty_sequences()
        if len(leading) != 1:
            raise ValueError(f"with cu_seqlens, expected packed [N, ·] logits or hidden states, got {list(leading)}")
        (N,) = leading
        layout = PackedLayout.from_cu_seqlens(cu_seqlens.to(device), N)
        S = layout.num_sequences
        mask = torch.ones(N, dtype=torch.bool, device=device) if mask is None else mask
        validate.check_packed("targets", targets, ((N,),), ("[N]",), device, floating=False)
        validate.check_packed("mask", mask, ((N,),), ("[N]",), device, floating=False)
        validate.check_mask(mask[None], 1, N, device)
        validate.check_targets(targets[None], mask[None].bool(), vocab, device)
        per_token = (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampling_logp", sampling_logp))
        for name, x in (*per_token, ("token_weights", token_weights)):
            validate.check_packed(name, x, ((N,),), ("[N]",), device)
        for name, x in (("advantages", advantages), ("is_ratio", is_ratio)):
            validate.check_packed(name, x, ((S,), (N,)), ("[S]", "[N]"), device)
        validate.check_packed("sequence_weights", sequence_weights, ((S,),), ("[S]",), device)
        if options.beta != 0.0 and ref_logp is None:
            raise ValueError(f"ref_logp is required when beta != 0 (beta={options.beta})")
        return cls(
            targets.long()[None],
            mask.bool()[None],
            advantages,
            old_logp,
            ref_logp,
            is_ratio,
            token_weights,
            sequence_weights,
            layout,
            sampling_logp,
        )._neutral_empty_sequences()

    def is_local(self) -> bool:
        """Whether this rank's statistics alone make the loss: no vocabulary shard, no sequence split."""
        return self.vocab_shard is None and self.sequence_group is None

    def sequence_kept(self) -> Tensor:
        """Whether each sequence has a kept token, [B] / [S]."""
        if self.layout is None:
            return self.mask.any(1)  # [B]
        kept = torch.zeros(self.layout.num_sequences, dtype=torch.bool, device=self.mask.device)
        return kept.index_fill_(0, self.layout.sequence[self.mask[0]], True)  # [S]

    def _neutral_empty_sequences(self) -> LossInputs:
        """Non-finite per-sequence values of sequences without a kept token as advantage 0, IS weight 1 and weight
        0: they are padding, which may hold anything (NaN included) and would reach the loss as 0 · NaN. (Finite
        ones stay: TRL's per-sequence metrics average over every sequence.)"""
        keep = self.sequence_kept()  # [B] / [S]
        tokens = self.mask.shape[1]

        def neutral(x: Tensor | None, fill: float, per_token_too: bool = True) -> Tensor | None:
            if x is None or x.dim() != 1 or (per_token_too and self.layout is not None and x.shape[0] == tokens):
                return x  # per-token values: build_terms neutralises their padding
            return torch.where(keep | torch.isfinite(x), x, fill)

        return dataclasses.replace(
            self,
            advantages=neutral(self.advantages, 0.0),
            is_ratio=neutral(self.is_ratio, 1.0),
            sequence_weights=neutral(self.sequence_weights, 0.0, per_token_too=False),
        )

    def check_finite(self, options: LossOptions) -> None:
        """ValueError naming the first tensor with NaN or ±inf at a kept token (a per-sequence one: at a sequence
        with a kept token), and its index; padding may hold anything. One host sync (`check_finite=True`).
        sampling_logp may hold NaN: TRL's mark of a token the sampler could not score (no off-policy evidence)."""
        mask, sequence_kept = (self.mask if self.layout is None else self.mask[0]), self.sequence_kept()
        names = ("advantages", "old_logp", "ref_logp", "sampling_logp", "is_ratio", "token_weights", "sequence_weights")

        def kept(name: str, x: Tensor) -> Tensor:
            if name == "sampling_logp":  # NaN: a token the sampler could not score
                return mask & ~torch.isnan(x)
            return mask if x.shape == mask.shape else sequence_kept

        named = [(name, x, kept(name, x)) for name in names if (x := getattr(self, name)) is not None]
        for name in ("num_items_in_batch", "num_sequences_in_batch"):  # normalisers: finite wherever they are
            value = getattr(options, name, None)
            if isinstance(value, Tensor):
                named.append((name, value.reshape(-1), torch.ones_like(value.reshape(-1), dtype=torch.bool)))
            elif value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        finite.check_finite_at_kept(named)

    def terms(self, logp: Tensor, entropy: Tensor | None, options: LossOptions) -> TokenTerms:
        """TokenTerms of the loss algebra from the pass's logp / entropy [R, C], in the padded view."""
        if self.layout is None:
            return build_terms(
                logp,
                self.old_logp,
                self.ref_logp,
                self.advantages,
                self.mask,
                entropy,
                self.is_ratio,
                options,
                self.token_weights,
                self.sequence_weights,
                self.sampling_logp,
                sequence_group=self.sequence_group,
            )
        pad, n = self.layout.pad, logp.shape[1]
        per_token = lambda x: pad(x) if x is not None and x.shape[0] == n else x  # noqa: E731  [N] -> [S, T_max]
        return build_terms(
            pad(logp[0]),
            pad(self.old_logp),
            pad(self.ref_logp),
            per_token(self.advantages),
            pad(self.mask[0], False),
            None if entropy is None else pad(entropy[0]),
            per_token(self.is_ratio),
            options,
            pad(self.token_weights),
            self.sequence_weights,
            pad(self.sampling_logp),
            sequence_group=self.sequence_group,
        )

    def kept_rows(self) -> tuple[Tensor, Tensor]:
        """(r, c) indices of the kept tokens in the [R, C] rows."""
        return self.mask.nonzero(as_tuple=True)

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

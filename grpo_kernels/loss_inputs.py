"""LossInputs: a loss call's per-token and per-sequence tensors, checked once, in either layout.

Padded: targets/mask/old/ref/token_weights `[B, T]`, advantages/is_ratio `[B]` or `[B, T]`, sequence_weights `[B]`.
Packed (`cu_seqlens`): the same per token as `[N]`, per sequence as `[S]`. The vocabulary pass sees `rows` of
shape `[R, C]` (`[B, T]`, or `[1, N]` packed); the loss algebra sees the padded `[B, T]` (or `[S, T_max]`) view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels import checks
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
    ) -> LossInputs:
        """Check everything against the leading dims of logits/hidden (`(B, T)`, or `(N,)` with cu_seqlens)."""
        if cu_seqlens is None:
            if len(leading) != 2:
                raise ValueError(f"expected [B, T, ·] logits or hidden states, got leading dims {list(leading)}")
            B, T = leading
            mask = torch.ones((B, T), dtype=torch.bool, device=device) if mask is None else mask
            checks.check_mask(mask, B, T, device)
            checks.check_targets(targets, mask.bool(), vocab, device)
            checks.check_loss_inputs(B, T, device, advantages, old_logp, ref_logp, is_ratio, options)
            checks.check_per_token_float("token_weights", token_weights, B, T, device)
            checks.check_per_sequence_float("sequence_weights", sequence_weights, B, device)
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
            )
        if len(leading) != 1:
            raise ValueError(f"with cu_seqlens, expected packed [N, ·] logits or hidden states, got {list(leading)}")
        (N,) = leading
        layout = PackedLayout.from_cu_seqlens(cu_seqlens.to(device), N)
        S = layout.num_sequences
        mask = torch.ones(N, dtype=torch.bool, device=device) if mask is None else mask
        checks.check_packed("targets", targets, ((N,),), ("[N]",), device, floating=False)
        checks.check_packed("mask", mask, ((N,),), ("[N]",), device, floating=False)
        checks.check_mask(mask[None], 1, N, device)
        checks.check_targets(targets[None], mask[None].bool(), vocab, device)
        for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_weights", token_weights)):
            checks.check_packed(name, x, ((N,),), ("[N]",), device)
        for name, x in (("advantages", advantages), ("is_ratio", is_ratio)):
            checks.check_packed(name, x, ((S,), (N,)), ("[S]", "[N]"), device)
        checks.check_packed("sequence_weights", sequence_weights, ((S,),), ("[S]",), device)
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
        )

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

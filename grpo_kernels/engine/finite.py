"""Non-finite values: the inputs' values at kept tokens, and the blame for a bad row of the vocabulary pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels.engine.sync import ValueCheck
from grpo_kernels.tensor_checks import raise_first

# Non-finite values (`check_finite=True`). A kept token's values must be finite; padding may hold anything, NaN
# included, because it is never read. O(B·T) values, never a pass over [N, V].

FINITE_AT_KEPT = "be finite where the mask keeps a token"


def input_checks(
    named: Sequence[tuple[str, Tensor]], mask: Tensor, sequence_kept: Tensor, *, packed: bool
) -> list[ValueCheck]:
    """The value checks of a loss call's tensors `named` (`[B, T]` / `[N]` per token, `[B]` / `[S]` per sequence):
    NaN or ±inf at a kept token (`mask`, the user's shape) or, per sequence, at a sequence with a kept token
    (`sequence_kept`) names the tensor and its first such index. sampling_logp may hold NaN: TRL's mark of a token
    the sampler could not score (no off-policy evidence).

    Padded inputs get one flag for all of them (`any_nonfinite_at_kept`), whose error path runs the exact
    per-tensor checks; packed ones a flag each."""

    def kept(name: str, x: Tensor) -> Tensor:
        if name == "sampling_logp":  # NaN: a token the sampler could not score
            return mask & ~torch.isnan(x)
        return mask if x.shape == mask.shape else sequence_kept

    exact = lambda: [(name, x, kept(name, x)) for name, x in named]  # noqa: E731
    if packed:
        return at_kept_checks(exact())
    blame = lambda: raise_failed(at_kept_checks(exact()))  # noqa: E731
    return [(any_nonfinite_at_kept(named, mask, nan_ok="sampling_logp"), blame)]


def at_kept_checks(named: Sequence[tuple[str, Tensor, Tensor]]) -> list[ValueCheck]:
    """A check for each `(name, x, kept)`: x holds NaN or ±inf where `kept` (bool, x's shape) is set; its error
    names x, the value and its index in x."""
    checks = []
    for name, x, kept in named:
        bad = nonfinite(x) & kept
        checks.append((bad.any(), lambda name=name, x=x, bad=bad: raise_first(name, x, bad, FINITE_AT_KEPT)))
    return checks


def raise_failed(checks: Sequence[ValueCheck]) -> None:
    """Raise the first failed check's error (each flag read on its own: an error path)."""
    for flag, fail in checks:
        if bool(flag):
            fail()


def any_nonfinite_at_kept(named: Sequence[tuple[str, Tensor]], mask: Tensor, nan_ok: str = "") -> Tensor:
    """One flag for all of `named` ([B, T], or [B] counted at its row's kept tokens; `nan_ok`'s NaN passes): their
    sum at the kept tokens is not finite, so one of them is not there (or the sum overflowed: the exact per-tensor
    checks then find nothing). A handful of ops for every tensor together: at small shapes the checks' op count is
    their cost."""
    total = None
    for name, x in named:
        x = x.detach() if x.requires_grad else x
        x = x.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf) if name == nan_ok else x
        x = x if x.dim() == mask.dim() else x[:, None]
        total = x if total is None else total + x
    return nonfinite_sum(total, mask)


def nonfinite_sum(x: Tensor, kept: Tensor | None) -> Tensor:
    """0-dim bool: the sum of x where `kept` (None: everywhere) is not finite, i.e. one of those values is not (or
    the sum overflowed: the caller's exact test then finds nothing). A cheap first test for a whole tensor."""
    return nonfinite((x if kept is None else torch.where(kept, x, 0.0)).sum())


def nonfinite(x: Tensor) -> Tensor:
    """`~torch.isfinite(x)` in two ops instead of five (x − x is exactly 0 where x is finite, NaN elsewhere): the
    checks run on every call, and at small shapes their op count is their cost."""
    if not x.is_floating_point():
        return ~torch.isfinite(x)
    x = x.detach() if x.requires_grad else x
    return (x - x) != 0


LOGITS_CAUSES = "NaN or inf logits, or logits · logit_scale / temperature overflowing"
LINEAR_SOURCE = "hidden @ weight.T + bias"  # the fused lm_head's logits are never stored: blame its inputs
LINEAR_CAUSES = "NaN or inf in hidden, weight or bias, or their product overflowing"


@dataclass(frozen=True)
class RowCheck:
    """How `check_row_stats` blames a bad row of the vocabulary pass: `source` (the logits' name) and `causes`;
    the user's index of a row: the statistics' `[B, T]` index, `n` where `flat`, through `kept` (r, c) when the pass
    saw only those rows; `zero_prob_ok` lets a target of probability 0 (its logit −inf, so logp = −inf) pass (a
    log-prob call's; a loss refuses it). Called by the kernels with the pass's (lse, logp, kept rows) after the
    forward."""

    source: str = "logits"
    causes: str = LOGITS_CAUSES
    flat: bool = False
    kept: tuple[Tensor, Tensor] | None = None
    zero_prob_ok: bool = True

    def __call__(self, lse: Tensor, logp: Tensor, kept: Tensor | None) -> None:
        check_row_stats(lse, logp, kept, self)

    def position(self, flat: int, index: list[int]) -> object:
        """The user's index of the statistics' `flat`-th entry, whose index in their shape is `index`."""
        if self.kept is not None:
            r, c = (int(i[flat]) for i in self.kept)
            return c if self.flat else (r, c)
        if self.flat:
            return flat
        return index[0] if len(index) == 1 else tuple(index)


def check_row_stats(lse: Tensor, logp: Tensor, kept: Tensor | None, rows: RowCheck) -> None:
    """ValueError if a kept row's log-sum-exp is not finite or its target's logp is NaN (or −inf, unless
    `rows.zero_prob_ok`). lse, logp: the pass's O(N) statistics, any shape; kept: bool of that shape (None: all).
    One host sync; a handful of ops while every row is good (their sum is finite), the exact test after."""
    ok_logp = logp.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0) if rows.zero_prob_ok else logp
    if not bool(nonfinite_sum(lse + ok_logp, kept)):
        return
    if rows.zero_prob_ok:
        bad = nonfinite(lse) | torch.isnan(logp)
    else:  # a NaN or an infinite logp
        bad = nonfinite(lse) | nonfinite(logp)
    if kept is not None:
        bad = bad & kept
    if not bool(bad.any()):
        return  # the sum overflowed
    flat = int(bad.reshape(-1).nonzero()[0])
    index, rest = [], flat
    for size in reversed(bad.shape):
        rest, i = divmod(rest, size)
        index.insert(0, i)
    where = rows.position(flat, index)
    row_lse, row_logp = lse.reshape(-1)[flat].item(), logp.reshape(-1)[flat].item()
    if math.isfinite(row_lse) and not math.isnan(row_logp):
        raise ValueError(
            f"{rows.source} give the target token probability 0 (logp = -inf: its logit is -inf) at index {where}, "
            "where the loss's ratio and log terms are undefined; mask that token, or pass check_finite=False to "
            "compute with logp = -inf (as TRL does)"
        )
    raise ValueError(
        f"{rows.source} must have a finite log-sum-exp at kept tokens, got {row_lse} (logp {row_logp}) at index "
        f"{where}: {rows.causes}"
    )


def check_kept_mass(log_kept_mass: Tensor, mask: Tensor, rows: RowCheck) -> None:
    """ValueError for a kept token whose row holds NaN or +inf outside the sampler's kept set. Replay renormalises
    over that set, so its log-sum-exp never sees them; the whole row's does, and shows in the log kept mass
    log S = lse_support − lse_full (NaN, or −inf for a +inf logit; the support's own non-finite lse was refused
    by `check_row_stats` first). log_kept_mass, mask: [R, C]. One host sync."""
    if not bool(nonfinite_sum(log_kept_mass, mask)):
        return
    bad = nonfinite(log_kept_mass) & mask
    r, c = (int(i) for i in bad.nonzero()[0])
    where = c if rows.flat else (r, c)
    raise ValueError(
        f"{rows.source} must have a finite log-sum-exp at kept tokens, got a non-finite one over the whole vocabulary "
        f"(NaN or +inf outside the sampler's kept set) at index {where}: {rows.causes}"
    )

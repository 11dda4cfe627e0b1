"""Sampling replay in a call's plan: the sampler's rule (top_k, top_p, min_p) or its kept-token mask (checked by
`validate.check_replay`) turned into the pass's `kernels.replay.Replay`, its kept ids in the order of the rows the
pass runs.

`SamplingMask` is vLLM's CSR form of the kept sets (`return_sampling_mask`): position i keeps
token_ids[offsets[i]:offsets[i + 1]]. The padded form is an int tensor of the targets' shape then K, `[B, T, K]` (packed
or flat: `[N, K]`; `[B·T, K]` flattened), with -1 padding. Positions follow the flattened order of the targets. A
position's ids are a set: an id given twice is kept once. A position the mask keeps needs at least one id (an empty kept
set there is a ValueError naming it: a sampler keeps at least the token it sampled); a masked position is never read, so
its set may be empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.kernels.pass_options import Replay
from grpo_kernels.kernels.replay import REPLAY_STATS


@dataclass(frozen=True)
class SamplingMask:
    """The tokens a sampler kept at each position, in vLLM's CSR form: `token_ids` int [nnz] and `offsets` int
    [positions + 1] (0 first, nondecreasing, len(token_ids) last); position i keeps
    token_ids[offsets[i]:offsets[i + 1]] (a set: an id given twice is kept once; empty only where the mask drops the
    position), positions in the flattened order of the targets ([B, T], or packed [N])."""

    token_ids: Tensor
    offsets: Tensor


def replay_of(
    rule,
    sampling_mask: Any,
    *,
    replays: bool,
    leading: tuple[int, ...],
    mask: Tensor,
    vocab: int,
    device: torch.device,
    stats: tuple[str, ...],
    full_entropy: bool,
    kept,
) -> Replay | None:
    """The pass's Replay, or None when the call replays nothing and asks for no replay statistic. `rule` holds
    top_k, top_p, min_p (the Request or the LossOptions), `leading` the targets' shape, `mask` the pass's kept
    tokens [R, C], `kept` the fused lm_head's `KeptRows` (None: logits in); `replays` whether it truncates
    (`validate.check_replay`, whose checks have passed: this only builds)."""
    if not replays and not any(name in REPLAY_STATS for name in stats):
        return None
    ids = None if sampling_mask is None else kept_ids(sampling_mask, leading, mask).to(device)  # [R·C, K]
    if ids is not None and kept is not None:
        if kept.row_mask is None:  # only the kept rows run (every row runs, masked, inside a capture)
            ids = ids.view(*mask.shape, ids.shape[-1])[kept.index]  # [M, K]: the fused lm_head's rows
    top_k = rule.top_k if rule.top_k < vocab else 0
    return Replay(
        top_k=top_k, top_p=float(rule.top_p), min_p=float(rule.min_p), kept_ids=ids, full_entropy=full_entropy
    )


def kept_ids(sampling_mask: Any, leading: tuple[int, ...], mask: Tensor) -> Tensor:
    """The kept ids as [R·C, K] int64 with -1 padding, from a `SamplingMask` or a padded tensor of the targets'
    shape `leading` ([B, T] or [N]) then K (its type, shape and ids checked by `validate.check_sampling_mask`), and
    every position `mask` keeps ([R, C] bool) given at least one id (a host read). Duplicate ids count once: a
    position's ids are a set."""
    positions = mask.numel()
    ids = (
        _from_csr(sampling_mask, positions) if isinstance(sampling_mask, SamplingMask) else _from_padded(sampling_mask)
    )
    empty = (ids < 0).all(dim=-1) & mask.reshape(-1).to(ids.device)  # [R·C]
    if bool(empty.any()):
        first = int(empty.nonzero()[0])
        where = first if len(leading) == 1 else divmod(first, leading[1])
        raise ValueError(
            f"sampling_mask keeps no token at index {where}, a position the mask keeps: a sampler keeps at least the "
            "token it sampled, so an empty kept set there is a data error (equal offsets, or a row of -1); mask that "
            "position, or give its kept ids"
        )
    return ids


def _from_padded(sampling_mask: Tensor) -> Tensor:
    """A padded `[*leading, K]` (or flattened `[positions, K]`) integer tensor with -1 padding
    (`validate.check_sampling_mask` checked it) as [positions, K] int64."""
    return sampling_mask.reshape(-1, sampling_mask.shape[-1]).long()


def _from_csr(mask: SamplingMask, positions: int) -> Tensor:
    """A CSR SamplingMask (`validate.check_sampling_mask` checked it) as padded ids [positions, K] (K the largest
    kept set)."""
    offsets, ids = mask.offsets.long().to(mask.token_ids.device), mask.token_ids.long()
    counts = offsets.diff()  # [positions]
    width = max(int(counts.max()) if positions else 0, 1)
    position = torch.repeat_interleave(torch.arange(positions, device=ids.device), counts)  # [nnz]
    column = torch.arange(ids.shape[0], device=ids.device) - offsets[position]  # [nnz]
    padded = torch.full((positions, width), -1, dtype=torch.long, device=ids.device)
    padded[position, column] = ids
    return padded


def pass_stats(stats: tuple[str, ...], replay: Replay | None, loss: bool, checked: bool) -> tuple[str, ...]:
    """The statistics the pass computes: those asked, for a replayed loss the replay statistics (its metrics), and
    for a call replaying kept ids whose rows are `checked` the log kept mass (`finite.check_kept_mass` reads it)."""
    if replay is None:
        return stats
    if loss:
        return tuple(dict.fromkeys((*stats, *REPLAY_STATS)))
    return tuple(dict.fromkeys((*stats, "log_kept_mass"))) if checked and replay.kept_ids is not None else stats

"""Sampling replay in a call's plan: the sampler's rule (top_k, top_p, min_p) or its kept-token mask, checked and
turned into the pass's `kernels.replay.Replay`, its kept ids in the order of the rows the pass runs.

`SamplingMask` is vLLM's CSR form of the kept sets (`return_sampling_mask`): position i keeps
token_ids[offsets[i]:offsets[i + 1]]. The padded form is an int tensor of the targets' shape then K, `[B, T, K]` (packed
or flat: `[N, K]`; `[B·T, K]` flattened), with -1 padding. Positions follow the flattened order of the targets. A
position's ids are a set: an id given twice is kept once. A position the mask keeps needs at least one id (an empty kept
set there is a ValueError naming it: a sampler keeps at least the token it sampled); a masked position is never read, so
its set may be empty.
"""

from __future__ import annotations

import math
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
    ids = None if sampling_mask is None else kept_ids(sampling_mask, leading, mask, vocab).to(device)  # [R·C, K]
    if ids is not None and kept is not None:
        if kept.row_mask is None:  # only the kept rows run (every row runs, masked, inside a capture)
            ids = ids.view(*mask.shape, ids.shape[-1])[kept.index]  # [M, K]: the fused lm_head's rows
    top_k = rule.top_k if rule.top_k < vocab else 0
    return Replay(
        top_k=top_k, top_p=float(rule.top_p), min_p=float(rule.min_p), kept_ids=ids, full_entropy=full_entropy
    )


def kept_ids(sampling_mask: Any, leading: tuple[int, ...], mask: Tensor, vocab: int) -> Tensor:
    """The kept ids as [R·C, K] int64 with -1 padding, from a `SamplingMask` or a padded tensor of the targets'
    shape `leading` ([B, T] or [N]) then K; ids checked inside [0, V), and every position `mask` keeps ([R, C]
    bool) given at least one id (a few host reads). Duplicate ids count once: a position's ids are a set."""
    positions = mask.numel()
    if isinstance(sampling_mask, SamplingMask):
        ids = _from_csr(sampling_mask, positions, vocab)
    else:
        ids = _from_padded(sampling_mask, leading, vocab)
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


def _from_padded(sampling_mask: Any, leading: tuple[int, ...], vocab: int) -> Tensor:
    """A padded `[*leading, K]` (or flattened `[positions, K]`) integer tensor with -1 padding, checked, as
    [positions, K] int64: the leading dimensions are the targets', not only their count, so that no position
    takes another's kept set."""
    if not isinstance(sampling_mask, Tensor) or sampling_mask.is_floating_point() or sampling_mask.dtype == torch.bool:
        raise TypeError(
            "sampling_mask must be a grpo_kernels.SamplingMask or an integer tensor [B, T, K] / [N, K] with -1 "
            f"padding, got {type(sampling_mask).__name__}"
            + (f" of {sampling_mask.dtype}" if isinstance(sampling_mask, Tensor) else "")
        )
    _check_readable("sampling_mask", sampling_mask)
    positions = math.prod(leading)
    flattened = sampling_mask.dim() == 2 and sampling_mask.shape[0] == positions
    if tuple(sampling_mask.shape[:-1]) != leading and not flattened:
        expected = f"[N, K] = [{positions}, K]"
        if len(leading) == 2:
            expected = f"[B, T, K] = [{leading[0]}, {leading[1]}, K] (or flattened: {expected.replace('N', 'B·T')})"
        raise ValueError(
            f"sampling_mask must be {expected}: the targets' shape, then the kept ids; got {list(sampling_mask.shape)}"
        )
    ids = sampling_mask.reshape(-1, sampling_mask.shape[-1]).long()
    _refuse_if(
        ((ids < -1) | (ids >= vocab)).any(), f"sampling_mask ids must lie in [0, V) = [0, {vocab}), with -1 as padding"
    )
    return ids


def _check_readable(name: str, x: Tensor) -> None:
    """A ValueError naming `name` for a tensor on the meta device: it has no values to read."""
    if x.device.type == "meta":
        raise ValueError(f"{name} must hold values, got a tensor on the meta device of shape {list(x.shape)}")


def _from_csr(mask: SamplingMask, positions: int, vocab: int) -> Tensor:
    """A CSR SamplingMask, checked, as padded ids [positions, K] (K the largest kept set)."""
    ids, offsets = mask.token_ids, mask.offsets
    for name, x in (("token_ids", ids), ("offsets", offsets)):
        if not isinstance(x, Tensor) or x.dim() != 1 or x.is_floating_point() or x.dtype == torch.bool:
            raise TypeError(f"sampling_mask.{name} must be a 1-D integer tensor, got {_described(x)}")
        _check_readable(f"sampling_mask.{name}", x)
    if offsets.shape[0] != positions + 1:
        raise ValueError(
            f"sampling_mask.offsets must have positions + 1 = {positions + 1} entries (one per target position, "
            f"and the end), got {offsets.shape[0]}"
        )
    offsets, ids = offsets.long().to(ids.device), ids.long()
    _refuse_if(
        (offsets[0] != 0) | (offsets[-1] != ids.shape[0]) | (offsets.diff() < 0).any(),
        f"sampling_mask.offsets must start at 0, never decrease and end at len(token_ids) = {ids.shape[0]}",
    )
    _refuse_if(((ids < 0) | (ids >= vocab)).any(), f"sampling_mask.token_ids must lie in [0, V) = [0, {vocab})")
    counts = offsets.diff()  # [positions]
    width = max(int(counts.max()) if positions else 0, 1)
    position = torch.repeat_interleave(torch.arange(positions, device=ids.device), counts)  # [nnz]
    column = torch.arange(ids.shape[0], device=ids.device) - offsets[position]  # [nnz]
    padded = torch.full((positions, width), -1, dtype=torch.long, device=ids.device)
    padded[position, column] = ids
    return padded


def _described(x: Any) -> str:
    return f"{x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def pass_stats(stats: tuple[str, ...], replay: Replay | None, loss: bool, checked: bool) -> tuple[str, ...]:
    """The statistics the pass computes: those asked, for a replayed loss the replay statistics (its metrics), and
    for a call replaying kept ids whose rows are `checked` the log kept mass (`finite.check_kept_mass` reads it)."""
    if replay is None:
        return stats
    if loss:
        return tuple(dict.fromkeys((*stats, *REPLAY_STATS)))
    return tuple(dict.fromkeys((*stats, "log_kept_mass"))) if checked and replay.kept_ids is not None else stats


def _refuse_if(flag: Tensor, message: str) -> None:
    """A ValueError when the 0-dim `flag` is set: the kept ids are read to be padded, so this host read is paid
    anyway, checks on or off."""
    if bool(flag):
        raise ValueError(message)

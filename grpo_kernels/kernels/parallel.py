"""The vocabulary pass on a vocabulary-sharded lm_head or logits (tensor parallel), merged through O(N) statistics.

Rank r of a process group holds the rows [start_r, start_r + V_r) of the [V, H] weight (or those columns of the
logits). It runs the backend's own vocabulary pass on its shard, a target outside the shard being an ordinary token
there (the shard's pass takes column 0 in its place and that logp is dropped), then the ranks merge per row:

  1. all-reduce MAX of the shard log-sum-exps lse_r                           -> m                      N floats
  2. all-reduce SUM of s_r = exp(lse_r − m), the owner's target logit z_t, and (with entropy)
     s_r·(H_r − log s_r)                                                       -> S, z_t, E         2N or 3N floats
     lse = m + log S,   logp = z_t − lse,   H = E / S + log S   (H = Σ_r w_r (H_r − log w_r), w_r = s_r / S)

The backward is local: each rank runs the backend's vocabulary backward on its shard with the global lse and
entropy (so its softmax is the global one) and takes the one-hot term back out of the rows whose target it does not
own (column 0 then carries one rounding of g: an absolute error of ulp(g), the gradient's own scale); the fused
lm_head then forms dW of its shard and a partial dH, which one all-reduce SUM adds up (verl's convention, inside
`partial_hidden_grad`: left to the caller, 0 bytes).

Bytes communicated per call, R ranks, n rows of the pass (B·T for logits, the kept rows M for the fused lm_head),
float32 statistics, e = 1 with entropy (else 0):
  16·R (all-gather of each shard's (start, size), int64)  +  4·(3 + e)·n  forward
  + H·itemsize(hidden)·n  backward of the fused lm_head (the dH all-reduce; none for logits in).
Nothing of size [N, V] or [V, H] crosses ranks. Sampling replay adds, per row, 4 bytes for min-p's max, 4·R·top_k
for top-k's candidates, 4 for top-p's kept mass, and 4 + 4 + 4 to merge the full lse and the outside flags
(`merge_replay`, when those statistics are asked).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.kernels import transform
from grpo_kernels.kernels.replay import RowReduce
from grpo_kernels.kernels.replay import all_reduce as _all_reduce

_REDUCE_HIDDEN_GRAD = contextvars.ContextVar("reduce_hidden_grad", default=True)


@contextlib.contextmanager
def partial_hidden_grad() -> Iterator[None]:
    """Within it, a fused lm_head on a vocabulary shard leaves dH as this rank's share instead of all-reducing it:
    verl's and Megatron's convention, where the caller's sequence-parallel region sums the shares."""
    token = _REDUCE_HIDDEN_GRAD.set(False)
    try:
        yield
    finally:
        _REDUCE_HIDDEN_GRAD.reset(token)


def reduce_hidden_grad() -> bool:
    """Whether the fused lm_head's dH is all-reduced over the vocabulary shards (not inside `partial_hidden_grad`)."""
    return _REDUCE_HIDDEN_GRAD.get()


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice [start, start + size) of a vocabulary of `vocab` tokens, sharded over `group`."""

    group: Any
    start: int
    size: int
    vocab: int

    def local_targets(self, targets: Tensor) -> tuple[Tensor, Tensor]:
        """(targets as shard columns, 0 where the shard does not own the target; owned [same shape] bool)."""
        local = targets - self.start
        owned = (local >= 0) & (local < self.size)
        return torch.where(owned, local, 0), owned

    def placement(self, targets: Tensor, mask: Tensor) -> Placement:
        """The `Placement` of a pass's rows (whole-vocabulary `targets`, `mask`) on this shard."""
        local, owned = self.local_targets(targets)
        return Placement(local, mask, self, owned)


@dataclass(frozen=True)
class Placement:
    """Where a pass's rows' vocabulary lies, a step of every driver: whole in this process (`shard` None), or a
    vocabulary shard's columns, `targets` then the shard's columns (0 where another shard owns the target, `owned`
    False there) and the statistics merged over the group."""

    targets: Tensor
    mask: Tensor
    shard: VocabShard | None = None
    owned: Tensor | None = None

    def reduce(self, vocab: int) -> RowReduce:
        """How a row's values combine: whole here (`vocab` its length), or over the shard's group."""
        return RowReduce(vocab) if self.shard is None else RowReduce(self.shard.vocab, self.shard.group)

    def merge(self, lse: Tensor, logp: Tensor, entropy: Tensor | None, stats: dict[str, Tensor], opts):
        """The whole vocabulary's (lse, logp, entropy, {statistic}) from this shard's: `merge_stats`, or with replay
        `merge_replay` (`stats` the shard's "lse_full" and "outside")."""
        if opts.replay is None:
            merged = merge_stats(
                lse_r=lse, logp_r=logp, entropy_r=entropy, owned=self.owned, mask=self.mask, group=self.shard.group
            )
            return *merged, {}
        found = {"lse": lse, "logp": logp, **stats} | ({} if entropy is None else {"entropy": entropy})
        return merge_replay(found, self.owned, self.mask, opts, self.shard.group, self.reduce(0))

    def foreign(self, grad_logp: Tensor | None, rows: slice) -> Tensor | None:
        """dL/dlogp of `rows` (given at them) where another shard owns the target, 0 elsewhere (None without a shard
        or a gradient): the one-hot a shard's backward put in column 0 for them, before the chain rule."""
        if self.shard is None or grad_logp is None:
            return None
        return torch.where((self.owned | ~self.mask)[rows], 0.0, grad_logp)

    def remove_foreign(self, grad: Tensor, x0: Tensor, grad_logp: Tensor | None, opts, rows=slice(None)) -> None:
        """`remove_foreign_onehot` on this shard's gradient `rows` (`x0` column 0 of their raw logits)."""
        remove_foreign_onehot(grad, x0, (self.owned | ~self.mask)[rows], grad_logp, opts)


def vocab_shard(process_group: Any, local_size: int, vocab_start: int | None, stats: tuple[str, ...] = ()):
    """The VocabShard of this rank (None without a process group): one all-gather of each rank's (start, size).

    `vocab_start` None: shards lie in rank order, start = the sizes of the lower ranks. The shards must tile
    [0, V) without gap or overlap; anything else is a ValueError naming `vocab_start`.
    """
    if process_group is None:
        if vocab_start is not None:
            raise ValueError(f"vocab_start={vocab_start} needs a process_group (the vocabulary's shards)")
        return None
    merged = ("log_kept_mass", "outside_support")  # the replay statistics (`kernels.replay`)
    if any(name not in merged for name in stats):
        raise ValueError(
            f"stats {stats} are not merged across vocabulary shards: with process_group pass stats=() or {merged}"
        )
    if vocab_start is not None and vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(process_group) == "nccl" else None
    mine = torch.tensor([-1 if vocab_start is None else vocab_start, local_size], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=process_group)
    layout = torch.stack(parts).tolist()  # [[start or -1, size] per rank]
    given = [start >= 0 for start, _ in layout]
    if any(given) and not all(given):
        raise ValueError(f"vocab_start must be given on every rank of the group or on none, got {layout}")
    if not any(given):
        sizes = [size for _, size in layout]
        layout = [[sum(sizes[:r]), size] for r, size in enumerate(sizes)]
    end = 0
    for start, size in sorted(layout):
        if start != end:
            raise ValueError(
                f"vocab_start: the shards (start, size) {layout} do not tile [0, V) without gaps or overlaps"
            )
        end = start + size
    return VocabShard(process_group, layout[rank][0], local_size, end)


def merge_stats(
    *, lse_r: Tensor, logp_r: Tensor, entropy_r: Tensor | None, owned: Tensor, mask: Tensor, group: Any
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The whole vocabulary's (lse, logp, entropy) of each row from each shard's (lse_r, logp_r of its column
    target, entropy_r), all of one shape; two all-reduces (module doc). Rows where `mask` is False give 0."""
    lse_r, logp_r = lse_r.float(), logp_r.float()
    m = _all_reduce(lse_r.clone(), group, dist.ReduceOp.MAX)
    m = torch.where(torch.isfinite(m), m, 0.0)  # an all -inf (or NaN) row: lse stays non-finite below
    s = torch.exp(lse_r - m)  # [n]
    parts = [s, torch.where(owned, logp_r + lse_r, 0.0)]  # the owner's z_t = logp_r + lse_r
    if entropy_r is not None:
        parts.append(torch.where(s > 0, s * (entropy_r.float() - torch.log(s)), 0.0))  # 0 for an all -inf shard
    sums = _all_reduce(torch.stack(parts), group)  # [2 or 3, n]
    lse = m + torch.log(sums[0])
    logp = sums[1] - lse
    entropy = None if entropy_r is None else sums[2] / sums[0] + torch.log(sums[0])
    zero = lambda x: None if x is None else x.masked_fill(~mask, 0.0)  # noqa: E731
    return zero(lse), zero(logp), zero(entropy)


def merged_lse(lse_r: Tensor, group: Any) -> Tensor:
    """The whole row's log-sum-exp from each shard's [n] (max, then sum: two all-reduces)."""
    m = _all_reduce(lse_r.clone(), group, dist.ReduceOp.MAX)
    m = torch.where(torch.isfinite(m), m, 0.0)
    return m + torch.log(_all_reduce(torch.exp(lse_r - m), group))


def merge_replay(found: dict[str, Tensor], owned: Tensor, mask: Tensor, opts, group: Any, rows) -> tuple:
    """A replayed pass's per-shard statistics [n] ("logp", "lse" of the shard's kept columns, "entropy",
    "lse_full" of all its columns, "outside" on the owner) merged: (lse, logp, entropy or None, {each replay
    statistic of `opts.stats`}); `rows` the pass's `replay.RowReduce` (its whole vocabulary)."""
    lse, logp, entropy = merge_stats(
        lse_r=found["lse"], logp_r=found["logp"], entropy_r=found.get("entropy"), owned=owned, mask=mask, group=group
    )
    stats = {}
    if "log_kept_mass" in opts.stats:
        kept = (lse - merged_lse(found["lse_full"].float(), group)).clamp_(max=0.0).masked_fill_(~mask, 0.0)
        stats["log_kept_mass"] = kept if opts.replay.truncates(rows.vocab) else torch.zeros_like(kept)
    if "outside_support" in opts.stats:
        stats["outside_support"] = _all_reduce(found["outside"].int(), group, dist.ReduceOp.MAX).bool() & mask
    return lse, logp, entropy, stats


def remove_foreign_onehot(grad: Tensor, x0: Tensor, owned: Tensor, grad_logp: Tensor | None, opts) -> None:
    """In place: take g·dz/dx back out of column 0 of the gradient rows whose target another shard owns (the
    shard's backward put the one-hot there, for the column its forward stood in with). grad [..., V_r], x0 the raw
    logits of column 0 before the backward overwrote them, owned / grad_logp [...]."""
    if grad_logp is None:
        return
    foreign = grad_logp.float() * transform.slope(x0, opts.temperature, opts.logit_scale, opts.final_logit_softcapping)
    grad[..., 0].sub_(torch.where(owned, 0.0, foreign).to(grad.dtype))

"""Sampling replay: the vocabulary pass renormalised over a truncated sampler's support, on any backend.

A window of logits rows is copied into a compute-dtype scratch buffer and transformed there (z = transform(x)), the
tokens outside support ∪ {target} are set to -inf in place, and the backend's plain pass runs on that window with
the identity transform: its logp, entropy and gradient (onehot − q_support, 0 outside) are then exactly the
replayed ones, the support held fixed. The backward masks the window again (from each row's saved threshold, or
the kept ids) and applies the transform's chain rule. Extra memory: the scratch windows, never [N, V].

Rule replay (vLLM's order, `reference.sampler_support`): min-p on the whole distribution, then top-k, then top-p
on what is left; each is a per-row threshold θ (min-p: max z + log min_p; top-k: the k-th largest z; top-p: the
smallest kept candidate whose predecessors' mass is below top_p), so the support is {z ≥ θ}, ties all kept.
Kept-set replay: the support is the given ids of each row.

A target outside the support is counted as kept (its logp is finite and includes it) and flagged: precision can
put the sampled token a hair outside the trainer's own support, and NaN would end the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_kernels.kernels.pass_options import PassOptions, Replay
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.torch.token_logprobs import transform_

REPLAY_STATS = ("log_kept_mass", "outside_support")  # per-token statistics of a replayed pass (float32, bool)
WINDOW_ELEMENTS = 1 << 20  # logits per scratch window (4 MiB of float32)


@dataclass(frozen=True)
class RowReduce:
    """How per-row values combine over the pieces of a row: one process holds it whole (`group` None), or each rank
    of a vocabulary shard's `group` holds columns of it; `vocab` is the whole row's length."""

    vocab: int
    group: Any = None

    def max(self, x: Tensor) -> Tensor:
        return x if self.group is None else _all_reduce(x.contiguous(), self.group, dist.ReduceOp.MAX)

    def sum(self, x: Tensor) -> Tensor:
        return x if self.group is None else _all_reduce(x.contiguous(), self.group)

    def top(self, z: Tensor, k: int) -> Tensor:
        """The k largest values of each row [C, k], descending; on shards from every shard's own k largest (one
        all-gather of R·k values per row)."""
        local = z.topk(min(k, z.shape[-1]), dim=-1).values  # [C, ≤k]
        if self.group is None:
            return local
        local = torch.nn.functional.pad(local, (0, k - local.shape[-1]), value=-math.inf).contiguous()  # [C, k]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1).topk(k, dim=-1).values  # [C, k]


def _all_reduce(x: Tensor, group: Any, op=dist.ReduceOp.SUM) -> Tensor:
    dist.all_reduce(x, op=op, group=group)
    return x


def _no_host_read(z: Tensor) -> bool:
    """Inside a torch.compile trace or a CUDA graph capture, where a value read on the host breaks the graph."""
    return torch.compiler.is_compiling() or (z.is_cuda and torch.cuda.is_current_stream_capturing())


def thresholds(z: Tensor, replay: Replay, rows: RowReduce) -> Tensor:
    """θ [C, 1] per row of the transformed window z [C, V] (a shard's columns with `rows.group`) such that the
    rule's support is {z ≥ θ}. On shards top-p needs top_k (its candidates; the engine checks)."""
    theta = z.new_full((z.shape[0], 1), -math.inf)
    if replay.min_p > 0.0:  # q_v ≥ min_p · max q  ⟺  z_v ≥ max z + log min_p
        theta = rows.max(z.amax(-1, keepdim=True)) + math.log(replay.min_p)
    candidates = None
    k = replay.top_k
    if 0 < k < rows.vocab:  # the k-th largest of all z: min-p keeps a prefix of the sorted z, so max(θ, it) is exact
        candidates = rows.top(z, k + 1)  # [C, k + 1], descending: the (k + 1)-th tells a tie at the k-th
        theta = torch.maximum(theta, candidates[:, k - 1 : k])
    if replay.top_p < 1.0:
        theta = torch.maximum(theta, _top_p_cut(z, replay.top_p, theta, candidates, k, rows))
    return theta


def _top_p_cut(z: Tensor, top_p: float, theta: Tensor, candidates: Tensor | None, k: int, rows: RowReduce) -> Tensor:
    """The smallest candidate whose predecessors' mass, renormalised over {z ≥ θ}, is below top_p, [C, 1]. The
    candidates are top-k's (k + 1 of them), or every z sorted; tokens tied with the k-th beyond the candidates
    count in the mass (one host read tells whether a window has any; counted anyway where no read may happen)."""
    extra = None
    if candidates is None:
        candidates = z.sort(dim=-1, descending=True).values  # [C, V]
    else:
        kth = candidates[:, k - 1 : k]  # [C, 1]
        tied = (candidates[:, k : k + 1] == kth) & (kth >= theta)  # [C, 1]: more tokens equal the k-th
        if _no_host_read(z) or bool(tied.any()):
            extra = rows.sum(torch.count_nonzero(z >= kth, dim=-1)[:, None]) - k  # [C, 1]: the tied beyond k
            extra = extra.masked_fill_(~tied, 0)
        candidates = candidates[:, :k]
    kept = candidates >= theta  # [C, K]
    top = candidates[:, :1].nan_to_num(0.0, neginf=0.0)  # [C, 1]: the row's max (0 for a row of -inf)
    mass = (candidates - top).exp_().masked_fill_(~kept, 0.0).sum(-1, keepdim=True)  # [C, 1]
    if extra is not None:
        mass += extra * (candidates[:, -1:] - top).exp()
    q = (candidates - top - mass.log()).exp_().masked_fill_(~kept, 0.0)  # [C, K]
    before = q.cumsum(-1).sub_(q)  # [C, K]: the mass ahead of each candidate
    return candidates.masked_fill(~(before < top_p) | ~kept, math.inf).amin(-1, keepdim=True)  # [C, 1]


def _row_lse(z: Tensor, out: Tensor) -> Tensor:
    """logsumexp of each row of z [C, V], [C]: max − log_softmax at the max (a log-prob in [−log V, 0], exact to
    rounding), through `out` [C, V]: on CPU a fused log_softmax is a few times faster than logsumexp."""
    top, at = z.max(dim=-1, keepdim=True)  # [C, 1] each
    lse = top - torch.log_softmax(z, dim=-1, out=out).gather(1, at)  # [C, 1]
    return torch.where(top == -math.inf, top, lse)[:, 0]  # a row of -inf: -inf


def mask_window_(z: Tensor, targets: Tensor, replay: Replay, ids: Tensor | None, theta: Tensor | None,
                 rows: RowReduce, owned: Tensor | None = None, lse_buffer: Tensor | None = None):  # fmt: skip
    """Set z [C, V] to -inf outside support ∪ {target} in place (targets [C, 1] inside [0, V); ids [C, K] the kept
    ids, or θ [C, 1] from `thresholds`, computed when None). On a shard, `owned` [C] says which rows' target is
    this shard's (the others' stand-in column is not kept for them). Returns (this window's lse over its columns
    [C] through `lse_buffer` [C, V], None without one; target outside [C] bool (owned rows only); θ)."""
    lse_full = None if lse_buffer is None else _row_lse(z, lse_buffer)  # [C]
    target_z = z.gather(1, targets)  # [C, 1]
    if ids is not None:
        V = z.shape[-1]
        keep = torch.zeros(z.shape[0], V + 1, dtype=torch.bool, device=z.device)  # [C, V + 1]: column V takes -1
        keep.scatter_(1, ids.masked_fill((ids < 0) | (ids >= V), V), True)
        drop = ~keep[:, :V]  # [C, V]
    else:
        if theta is None:
            theta = thresholds(z, replay, rows)
        drop = z < theta  # [C, V]
    outside = drop.gather(1, targets)[:, 0]  # [C]
    z.masked_fill_(drop, -math.inf)
    if owned is not None:
        outside &= owned
        target_z = torch.where(owned[:, None], target_z, z.gather(1, targets))
    z.scatter_(1, targets, target_z)
    return lse_full, outside, theta


@dataclass
class Window:
    """One window of a replayed pass: the masked transformed logits z [C, V] (a view of the scratch buffer), the
    full lse, the outside flags and the rule's θ (None for kept ids)."""

    z: Tensor
    lse_full: Tensor | None
    outside: Tensor
    theta: Tensor | None


class Scratch:
    """The compute-dtype buffers of one call's windows, allocated on first use and reused."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (rows, vocab), compute_dtype(dtype), device
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, rows: int) -> Tensor:
        if name not in self._buffers:
            self._buffers[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._buffers[name][:rows]


def window_rows(vocab: int, rows: int) -> int:
    """Rows per scratch window: `WINDOW_ELEMENTS` logits, at least 1, at most `rows`."""
    return max(1, min(rows, WINDOW_ELEMENTS // max(vocab, 1)))


def row_ids(replay: Replay, rows: slice) -> Tensor | None:
    """The kept ids [C, K] of the pass's `rows` (None for rule replay)."""
    return None if replay.kept_ids is None else replay.kept_ids[rows]


def masked_window(x: Tensor, targets: Tensor, replay: Replay, ids, theta, opts, scratch: Scratch,
                  rows: RowReduce | None = None, owned: Tensor | None = None,
                  forward: bool = True) -> Window:  # fmt: skip
    """x [C, V] logits rows (any dtype) copied into scratch, transformed (`opts.transform`, `opts.temperature`) and
    masked to the support ∪ {target}; targets [C]; `rows` / `owned` on a vocabulary shard (`mask_window_`). The
    backward's window (`forward=False`) skips the full lse."""
    z = scratch.get("z", x.shape[0]).copy_(x)
    transform_(z, opts.temperature, opts.logit_scale, opts.final_logit_softcapping)
    safe = targets.clamp(0, x.shape[-1] - 1).reshape(-1, 1)  # masked rows may hold any id
    rows = RowReduce(x.shape[-1]) if rows is None else rows
    lse_buffer = scratch.get("temp", x.shape[0]) if forward else None
    lse_full, outside, theta = mask_window_(z, safe, replay, ids, theta, rows, owned, lse_buffer)
    return Window(z, lse_full, outside, theta)


def window_forward(kernels, window: Window, targets: Tensor, mask: Tensor, with_entropy: bool, stats: tuple,
                   truncates: bool = True):  # fmt: skip
    """The backend's plain pass over the masked window: (logp, lse of the support, entropy or None, the statistics
    by name), [C] each; masked rows 0 (False). Without truncation the log kept mass is 0 exactly."""
    logp, lse, entropy, kernel_stats = kernels.token_logprobs_fwd(
        window.z[None],
        targets[None],
        mask[None],
        1.0,
        with_entropy,
        stats=tuple(s for s in stats if s not in REPLAY_STATS),
    )
    logp, lse = logp[0], lse[0]
    found = {name: x[0] for name, x in kernel_stats.items()}
    if "log_kept_mass" in stats:  # log S = lse_support − lse_full ≤ 0
        found["log_kept_mass"] = (lse - window.lse_full.to(lse.dtype)).clamp_(max=0.0).masked_fill_(~mask, 0.0)
        if not truncates:
            found["log_kept_mass"].zero_()
    if "outside_support" in stats:
        found["outside_support"] = window.outside & mask
    return logp, lse, None if entropy is None else entropy[0], found


def window_grad_(kernels, window: Window, x: Tensor, targets, mask, lse, entropy, grad_logp, grad_entropy, opts,
                 scratch: Scratch, foreign: Tensor | None = None) -> Tensor:  # fmt: skip
    """dL/dx [C, V] (in the window's scratch) of the masked window's logp / entropy: the backend's backward on z in
    place, then the transform's chain rule dz/dx = s/T, or s/T·sech²(s·x/c) soft-capped. Outside the support 0.
    On a vocabulary shard `foreign` [C] is the one-hot the backward put in column 0 for rows whose target another
    shard owns (`parallel.remove_foreign_onehot`), taken back out before the chain rule."""
    z = window.z[None]
    kernels.token_logprobs_bwd(
        z,
        targets[None],
        mask[None],
        lse[None],
        None if entropy is None else entropy[None],
        None if grad_logp is None else grad_logp[None],
        None if grad_entropy is None else grad_entropy[None],
        1.0,
        z,
    )
    grad = window.z
    if foreign is not None:
        grad[:, 0].sub_(foreign.to(grad.dtype))
    slope = opts.logit_scale / opts.temperature
    cap = opts.final_logit_softcapping
    if cap is not None:  # masked rows may hold NaN logits: their 0 stays 0
        sech2 = scratch.get("temp", x.shape[0]).copy_(x).mul_(opts.logit_scale / cap)
        grad.mul_(sech2.cosh_().square_().reciprocal_().mul_(slope))  # 1/cosh², not 1 − tanh² (cancels near ±1)
        grad.masked_fill_(~mask[:, None], 0.0)
    elif slope != 1.0:
        grad.mul_(slope)
    return grad


def chunk_state(z: Tensor, targets: Tensor, opts: PassOptions, rows: slice, scratch: Scratch, theta: Tensor | None,
                full_lse: Tensor | None) -> ChunkState:  # fmt: skip
    """A chunk's state for `chunk_grad` again, in the backward: its window masked from the saved θ [c, 1] (or the
    kept ids), and the full pass's saved lse [1, c] (or None)."""
    window = masked_window(
        z[0], targets[0], opts.replay, row_ids(opts.replay, rows), theta, opts, scratch, forward=False
    )
    return ChunkState(window, full_lse)


@dataclass
class ChunkState:
    """What the gradient of one chunk of the fused lm_head needs from its replayed forward: the masked window, and
    with the full distribution's entropy that pass's lse [1, c]."""

    window: Window
    full_lse: Tensor | None = None


def chunk_forward(kernels, z: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions, rows: slice, scratch: Scratch,
                  theta: Tensor | None = None):  # fmt: skip
    """The replayed pass over one chunk z [1, c, V] of the fused lm_head's logits (read only), targets and mask
    [1, c], `rows` its slice of the pass's rows: (logp, lse of the support, entropy or None, {statistic}, state),
    [1, c] each. The entropy is the support's, or with `Replay.full_entropy` the whole distribution's."""
    replay: Replay = opts.replay
    full = replay.full_entropy and opts.with_entropy
    window = masked_window(z[0], targets[0], replay, row_ids(replay, rows), theta, opts, scratch)
    logp, lse, entropy, stats = window_forward(
        kernels, window, targets[0], mask[0], opts.with_entropy and not full, opts.stats, replay.truncates(z.shape[-1])
    )
    state = ChunkState(window)
    entropy = None if entropy is None else entropy[None]
    if full:  # the ordinary pass for the entropy
        _, state.full_lse, entropy, _ = kernels.token_logprobs_fwd(
            z, targets, mask, opts.temperature, True, **opts.transform()
        )
    return logp[None], lse[None], entropy, {name: x[None] for name, x in stats.items()}, state


def chunk_grad(kernels, state: ChunkState, z: Tensor, targets: Tensor, mask: Tensor, lse: Tensor,
               entropy: Tensor | None, grad_logp: Tensor | None, grad_entropy: Tensor | None, opts: PassOptions,
               scratch: Scratch) -> Tensor:  # fmt: skip
    """dL/dlogits [c, V] (compute dtype, in scratch) of one chunk from its `chunk_forward` state; z [1, c, V] the
    chunk's logits, overwritten with the full entropy's gradient when that is asked; the rest [1, c]."""
    full = state.full_lse is not None
    grad = window_grad_(
        kernels,
        state.window,
        z[0],
        targets[0],
        mask[0],
        lse[0],
        None if full or entropy is None else entropy[0],
        None if grad_logp is None else grad_logp[0],
        None if full or grad_entropy is None else grad_entropy[0],
        opts,
        scratch,
    )
    if full and grad_entropy is not None:
        kernels.token_logprobs_bwd(
            z, targets, mask, state.full_lse, entropy, None, grad_entropy, opts.temperature, z, **opts.transform()
        )
        grad.add_(z[0])
    return grad


def chunk_scratch(opts: PassOptions, rows: int, weight: Tensor) -> Scratch | None:
    """The scratch of a replayed fused lm_head's chunks of `rows` (None without replay), in the compute dtype."""
    return None if opts.replay is None else Scratch(rows, weight.shape[0], weight.dtype, weight.device)

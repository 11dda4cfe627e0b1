"""Sampling replay: the vocabulary pass renormalised over a truncated sampler's support, on any backend.

A window of logits rows is transformed (z = transform(x)), the tokens outside support ∪ {target} are set to -inf in
place, and the backend's plain pass runs on that window with the identity transform: its logp, entropy and gradient
(onehot − q_support, 0 outside) are then exactly the replayed ones, the support held fixed. The backward masks the
window again (from each row's saved threshold, or the kept ids) and applies the transform's chain rule. A chunk of
the fused lm_head is masked in its own buffer (`masks_in_place`); the logits API's rows, a soft-capped chunk and
one whose whole distribution's entropy is asked are copied into a compute-dtype scratch first. Extra memory: the
scratch windows, never [N, V].

Rule replay (vLLM's order, `reference.sampler_support`): min-p on the whole distribution, then top-k, then top-p
on what is left; each is a per-row threshold θ (min-p: max z + log min_p; top-k: the k-th largest z; top-p: the
smallest kept candidate whose predecessors' mass is below top_p, from top-k's candidates or by a binned scan of
the row, `top_p_scan`, never a sort of it), so the support is {z ≥ θ}, ties all kept.
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
from grpo_kernels.kernels.transform import chain_rule_, transform_

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


def fill_below_(z: Tensor, theta: Tensor, value: float = -math.inf) -> Tensor:
    """z [C, V] ← `value` where z < θ [C, 1], in place; a row whose θ is NaN is left whole. On the CPU (eager) one
    `threshold_` per row (x > t ? x : value, t the float just below θ): `masked_fill_` there costs about fifteen
    elementwise passes. The threshold also replaces NaN, so a row holding one gets a NaN θ (`thresholds`)."""
    if z.device.type != "cpu" or torch.compiler.is_compiling():
        return z.masked_fill_(z < theta, value)
    below = torch.nextafter(theta, theta.new_full((), -math.inf))[:, 0].tolist()
    for row, t in zip(z, below, strict=True):
        if t == t and t != -math.inf:  # NaN: the row is left whole; -inf: nothing lies below
            torch.nn.functional.threshold_(row, t, value)
    return z


def thresholds(z: Tensor, replay: Replay, rows: RowReduce, scratch: Scratch | None = None) -> Tensor:
    """θ [C, 1] per row of the transformed window z [C, V] (a shard's columns with `rows.group`) such that the
    rule's support is {z ≥ θ}; NaN for a row that holds NaN (masking leaves it whole: its pass gives NaN). On
    shards top-p needs top_k (its candidates; the engine checks). `scratch`: top-p's scan (None: it sorts the
    rows)."""
    top = rows.max(z.amax(-1, keepdim=True))  # [C, 1]
    theta = z.new_full((z.shape[0], 1), -math.inf)
    if replay.min_p > 0.0:  # q_v ≥ min_p · max q  ⟺  z_v ≥ max z + log min_p
        theta = top + math.log(replay.min_p)
    candidates = None
    k = replay.top_k
    if 0 < k < rows.vocab:  # the k-th largest of all z: min-p keeps a prefix of the sorted z, so max(θ, it) is exact
        candidates = rows.top(z, k + 1)  # [C, k + 1], descending: the (k + 1)-th tells a tie at the k-th
        theta = torch.maximum(theta, candidates[:, k - 1 : k])
    if replay.top_p < 1.0:
        if candidates is None and scratch is not None and rows.group is None and not _no_host_read(z):
            cut = top_p_scan(z, replay.top_p, theta, top, scratch)
        else:
            cut = _top_p_cut(z, replay.top_p, theta, candidates, k, rows)
        theta = torch.maximum(theta, cut)
    return theta.masked_fill_(top.isnan(), math.nan)


TOP_P_BINS = 8192  # value bins of top-p's scan between a row's max and its smallest kept logit


def top_p_scan(z: Tensor, top_p: float, theta: Tensor, top: Tensor, scratch: Scratch) -> Tensor:
    """top-p's cut of each row of z [C, V] over {z ≥ θ} without sorting the row, [C, 1]: the kept tokens' masses
    binned by value below the row's max `top` [C, 1] (one scatter-add; a bin is a range of values, so ties share
    one), the bin where their mass from the top reaches top_p of the whole, then only that bin's tokens sorted and
    walked from the mass of the bins above. The rule's cut as `_top_p_cut`'s walk over the sorted row finds it, to
    the rounding of the summed masses."""
    C = z.shape[0]
    finite = z
    if not bool(top.isfinite().all()):  # rows holding NaN or +inf (their θ is NaN in the end), or only -inf
        finite = torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=-math.inf)
        top, theta = finite.amax(-1, keepdim=True), theta.nan_to_num(nan=-math.inf)
    safe_top = top.clamp(min=torch.finfo(z.dtype).min)  # a row of -inf: the masses are all 0
    mass = _masses(finite, theta, safe_top, scratch.get("temp", C))  # [C, V]: exp(z − top) over {z ≥ θ}, else 0
    # bins: u = (top − z) / width, width = (top − lo) / (BINS − 1), lo the smallest value a cut can take
    span = -math.log(torch.finfo(z.dtype).tiny)  # below top − span every mass is 0 (never a cut)
    lo = torch.maximum(finite.amin(-1, keepdim=True), safe_top - span)
    lo = torch.maximum(lo, theta.clamp(max=safe_top))
    width = (safe_top - lo).clamp_(min=torch.finfo(z.dtype).tiny) / (TOP_P_BINS - 1)  # [C, 1]
    u = torch.sub(safe_top, finite, out=scratch.get("bins", C)).div_(width).clamp_(0, TOP_P_BINS - 1)  # [C, V]
    at = scratch.get("bin_ids", C, torch.int64).copy_(u)  # [C, V]: each token's bin, ⌊u⌋
    cumulative = torch.zeros(C, TOP_P_BINS, dtype=mass.dtype, device=z.device).scatter_add_(1, at, mass).cumsum_(-1)
    need = cumulative[:, -1:] * top_p  # [C, 1]: top_p of the kept mass
    cut_bin = (cumulative < need).sum(-1, keepdim=True).clamp_(max=TOP_P_BINS - 1)  # [C, 1]: the first to reach it
    above = cumulative.gather(1, (cut_bin - 1).clamp_(min=0)).masked_fill_(cut_bin == 0, 0.0)  # [C, 1]
    # the cut bin's tokens: −u on (−(b + 1), −b], −inf elsewhere (the same tokens as ⌊u⌋ = b)
    inside = fill_below_(u.neg_(), torch.nextafter(-(cut_bin + 1.0), u.new_full((), math.inf)).to(u.dtype))
    inside = fill_below_(inside.neg_(), cut_bin.to(u.dtype), math.inf).neg_()
    count = int((inside > -math.inf).sum(-1).max()) if C else 0
    ids = inside.topk(max(count, 1), dim=-1).indices  # [C, K]: the bin's tokens, -inf past each row's count
    values = finite.gather(1, ids).masked_fill_(inside.gather(1, ids) == -math.inf, -math.inf)
    values, order = values.sort(dim=-1, descending=True)  # [C, K]
    masses = mass.gather(1, ids.gather(1, order))  # [C, K]
    before = masses.cumsum(-1).sub_(masses).add_(above)  # [C, K]: the mass ahead of each token
    kept = (before < need) & (values > -math.inf)
    return values.masked_fill(~kept, math.inf).amin(-1, keepdim=True)  # [C, 1]; a row of no mass: +inf


def _masses(z: Tensor, theta: Tensor, top: Tensor, buffer: Tensor) -> Tensor:
    """exp(z − top) where z ≥ θ, 0 elsewhere, [C, V] in `buffer`."""
    kept = buffer.copy_(z)
    if bool((theta > -math.inf).any()):
        fill_below_(kept, theta)
    return kept.sub_(top).exp_()


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


def keep_ids_(z: Tensor, ids: Tensor) -> Tensor:
    """z [C, V] ← -inf outside each row's kept ids [C, K] (-1 or any id outside [0, V): padding), in place: the
    kept values gathered, the row filled, the values put back (no [C, V] mask)."""
    V = z.shape[-1]
    padding = (ids < 0) | (ids >= V)  # [C, K]
    at = ids.masked_fill(padding, 0)
    values = z.gather(1, at).masked_fill_(padding, -math.inf)  # [C, K]
    return z.fill_(-math.inf).scatter_reduce_(1, at, values, "amax")  # padding's -inf never wins over a kept value


def mask_window_(z: Tensor, targets: Tensor, *, replay: Replay, ids: Tensor | None, theta: Tensor | None,
                 rows: RowReduce, owned: Tensor | None = None, scratch: Scratch | None = None,
                 with_lse: bool = False):  # fmt: skip
    """Set z [C, V] to -inf outside support ∪ {target} in place (targets [C, 1] inside [0, V); ids [C, K] the kept
    ids, or θ [C, 1] from `thresholds`, computed when None), a window of `window_rows` rows at a time through
    `scratch`'s "temp" buffer. On a shard, `owned` [C] says which rows' target is this shard's (the others'
    stand-in column is not kept for them). Returns (this window's lse over its columns [C] with `with_lse`, else
    None; target outside [C] bool (owned rows only); θ)."""
    C = z.shape[0]
    target_z = z.gather(1, targets)  # [C, 1]
    lse_full = z.new_empty(C) if with_lse else None
    thetas = [] if ids is None and theta is None else None
    step = window_rows(rows.vocab, C)
    for start in range(0, C, step):
        part = z[start : start + step]  # [c, V], every rank of a shard's group runs the same windows
        if with_lse:
            lse_full[start : start + step] = _row_lse(part, scratch.get("temp", part.shape[0]))
        if ids is not None:
            keep_ids_(part, ids[start : start + step])
            continue
        if thetas is not None:
            thetas.append(thresholds(part, replay, rows, scratch))
        fill_below_(part, thetas[-1] if thetas is not None else theta[start : start + step])
    if ids is not None:
        outside = ~(ids == targets).any(-1)  # [C]
    else:
        theta = torch.cat(thetas) if thetas is not None else theta
        outside = (target_z < theta)[:, 0]  # [C]
    if owned is not None:
        outside &= owned
        target_z = torch.where(owned[:, None], target_z, z.gather(1, targets))
    z.scatter_(1, targets, target_z)
    return lse_full, outside, theta


@dataclass
class Window:
    """One window of a replayed pass: the masked transformed logits z [C, V] (the logits' own buffer, or a view of
    the scratch buffer), the full lse, the outside flags and the rule's θ (None for kept ids)."""

    z: Tensor
    lse_full: Tensor | None
    outside: Tensor
    theta: Tensor | None


class Scratch:
    """The compute-dtype buffers of one call's windows ([rows, vocab] at most each), allocated on first use at the
    rows first asked and reused."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (rows, vocab), compute_dtype(dtype), device
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, rows: int, dtype: torch.dtype | None = None) -> Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < rows:
            shape, dtype = (rows, self.shape[1]), dtype or self.dtype
            buffer = self._buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer[:rows]


def window_rows(vocab: int, rows: int) -> int:
    """Rows per scratch window: `WINDOW_ELEMENTS` logits, at least 1, at most `rows`."""
    return max(1, min(rows, WINDOW_ELEMENTS // max(vocab, 1)))


def row_ids(replay: Replay, rows: slice) -> Tensor | None:
    """The kept ids [C, K] of the pass's `rows` (None for rule replay)."""
    return None if replay.kept_ids is None else replay.kept_ids[rows]


def _transforms(opts: PassOptions) -> bool:
    """Whether the logit transform is other than the identity (temperature 1, scale 1, no soft-capping)."""
    return opts.temperature != 1.0 or opts.logit_scale != 1.0 or opts.final_logit_softcapping is not None


def masks_in_place(x: Tensor, opts: PassOptions) -> bool:
    """Whether a replayed pass may transform and mask the logits x [C, V] in their own buffer (a chunk of the fused
    lm_head, which nothing else reads): in the compute dtype, without soft-capping (its chain rule reads the raw
    logits) and without the whole distribution's entropy (its pass reads them unmasked)."""
    return (
        x.dtype == compute_dtype(x.dtype)
        and opts.final_logit_softcapping is None
        and not (opts.replay.full_entropy and opts.with_entropy)
    )


def masked_window(x: Tensor, targets: Tensor, *, ids: Tensor | None, theta: Tensor | None, opts: PassOptions,
                  scratch: Scratch, rows: RowReduce | None = None, owned: Tensor | None = None,
                  forward: bool = True, in_place: bool = False) -> Window:  # fmt: skip
    """x [C, V] logits rows transformed (`opts.transform`, `opts.temperature`) and masked to the support ∪
    {target}: in their own buffer with `in_place` (`masks_in_place`), else in a copy in scratch (any dtype);
    targets [C]; `rows` / `owned` on a vocabulary shard (`mask_window_`). The backward's window (`forward=False`)
    skips the full lse."""
    z = x if in_place else scratch.get("z", x.shape[0]).copy_(x)
    if _transforms(opts):
        transform_(z, opts.temperature, opts.logit_scale, opts.final_logit_softcapping)
    safe = targets.clamp(0, x.shape[-1] - 1).reshape(-1, 1)  # masked rows may hold any id
    rows = RowReduce(x.shape[-1]) if rows is None else rows
    lse_full, outside, theta = mask_window_(
        z, safe, replay=opts.replay, ids=ids, theta=theta, rows=rows, owned=owned, scratch=scratch, with_lse=forward
    )
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


@dataclass(frozen=True)
class RowGrads:
    """What the backward of a window's rows reads, [C] each: the targets (inside [0, V)), the kept rows, the lse of
    the support, and the entropy and upstream gradients (None where not taken)."""

    targets: Tensor
    mask: Tensor
    lse: Tensor
    entropy: Tensor | None = None
    grad_logp: Tensor | None = None
    grad_entropy: Tensor | None = None

    def at(self, rows: slice) -> RowGrads:
        """The record of `rows` of these rows."""
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        fields = (self.targets, self.mask, self.lse, self.entropy, self.grad_logp, self.grad_entropy)
        return RowGrads(*(pick(x) for x in fields))


def window_grad_(kernels, window: Window, x: Tensor, grads: RowGrads, opts: PassOptions, scratch: Scratch,
                 foreign: Tensor | None = None) -> Tensor:  # fmt: skip
    """dL/dx [C, V] (in the window's buffer) of the masked window's logp / entropy: the backend's backward on z in
    place, then the transform's chain rule (`transform.chain_rule_`). Outside the support 0. On a vocabulary shard
    `foreign` [C] is the one-hot the backward put in column 0 for rows whose target another shard owns
    (`parallel.remove_foreign_onehot`), taken back out before the chain rule."""
    z = window.z[None]
    one = lambda x: None if x is None else x[None]  # noqa: E731  [1, C]
    kernels.token_logprobs_bwd(
        z,
        grads.targets[None],
        grads.mask[None],
        grads.lse[None],
        one(grads.entropy),
        one(grads.grad_logp),
        one(grads.grad_entropy),
        1.0,
        z,
    )
    grad = window.z
    if foreign is not None:
        grad[:, 0].sub_(foreign.to(grad.dtype))
    if not _transforms(opts):
        return grad
    cap = opts.final_logit_softcapping
    buffer = None if cap is None else scratch.get("temp", x.shape[0])  # sech², soft-capped only
    return chain_rule_(grad, x, grads.mask, opts.temperature, opts.logit_scale, cap, buffer)


def chunk_state(z: Tensor, targets: Tensor, opts: PassOptions, rows: slice, scratch: Scratch, theta: Tensor | None,
                full_lse: Tensor | None) -> ChunkState:  # fmt: skip
    """A chunk's state for `chunk_grad` again, in the backward: its window masked from the saved θ [c, 1] (or the
    kept ids), and the full pass's saved lse [1, c] (or None)."""
    ids = row_ids(opts.replay, rows)
    in_place = masks_in_place(z[0], opts)
    window = masked_window(
        z[0], targets[0], ids=ids, theta=theta, opts=opts, scratch=scratch, forward=False, in_place=in_place
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
    """The replayed pass over one chunk z [1, c, V] of the fused lm_head's logits (masked in place where
    `masks_in_place`), targets and mask [1, c], `rows` its slice of the pass's rows: (logp, lse of the support,
    entropy or None, {statistic}, state), [1, c] each. The entropy is the support's, or with
    `Replay.full_entropy` the whole distribution's."""
    replay: Replay = opts.replay
    full = replay.full_entropy and opts.with_entropy
    ids, in_place = row_ids(replay, rows), masks_in_place(z[0], opts)
    window = masked_window(z[0], targets[0], ids=ids, theta=theta, opts=opts, scratch=scratch, in_place=in_place)
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


def chunk_grad(kernels, state: ChunkState, z: Tensor, grads: RowGrads, opts: PassOptions, scratch: Scratch) -> Tensor:
    """dL/dlogits [c, V] (compute dtype, in the chunk's buffer or scratch) of one chunk from its `chunk_forward`
    state; z [1, c, V] the chunk's logits, overwritten with the full entropy's gradient when that is asked; `grads`
    its rows' [c]."""
    full = state.full_lse is not None
    support = RowGrads(grads.targets, grads.mask, grads.lse, grad_logp=grads.grad_logp)
    grad = window_grad_(kernels, state.window, z[0], grads if not full else support, opts, scratch)
    if full and grads.grad_entropy is not None:
        kernels.token_logprobs_bwd(
            z,
            grads.targets[None],
            grads.mask[None],
            state.full_lse,
            grads.entropy[None],
            None,
            grads.grad_entropy[None],
            opts.temperature,
            z,
            **opts.transform(),
        )
        grad.add_(z[0])
    return grad


def chunk_scratch(opts: PassOptions, rows: int, weight: Tensor) -> Scratch | None:
    """The scratch of a replayed fused lm_head's chunks of `rows` (None without replay), in the compute dtype."""
    return None if opts.replay is None else Scratch(rows, weight.shape[0], weight.dtype, weight.device)

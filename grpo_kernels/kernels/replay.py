"""Sampling replay: the vocabulary pass renormalised over a truncated sampler's support, on any backend.

A window of logits rows is transformed (z = transform(x)), the tokens outside support ∪ {target} are set to -inf in
place, and the backend's plain pass runs on that window with the identity transform: its logp, entropy and gradient
(onehot − q_support, 0 outside) are then exactly the replayed ones, the support held fixed; where the support's
columns come free (kept ids, top-k's candidates) the pass runs on them gathered instead (`replay_narrow`). The
backward masks the window again (from each row's saved threshold, or the kept ids), then the chain rule. A chunk of
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

from grpo_kernels.kernels import replay_narrow as narrow_rows
from grpo_kernels.kernels.pass_options import PassOptions, Replay
from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs, compute_dtype
from grpo_kernels.kernels.replay_narrow import Narrow, keep_ids_
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
        return x if self.group is None else all_reduce(x.contiguous(), self.group, dist.ReduceOp.MAX)

    def sum(self, x: Tensor) -> Tensor:
        return x if self.group is None else all_reduce(x.contiguous(), self.group)

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


def all_reduce(x: Tensor, group: Any, op=dist.ReduceOp.SUM) -> Tensor:
    """x reduced over `group` in place (`op`: SUM unless given), returned."""
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
    """θ [C, 1] per row (`rule_support`)."""
    return rule_support(z, replay, rows, scratch)[0]


def rule_support(z: Tensor, replay: Replay, rows: RowReduce, scratch: Scratch | None = None):
    """(θ, columns) of the transformed window z [C, V] (a shard's columns with `rows.group`): θ [C, 1] per row such
    that the rule's support is {z ≥ θ}, NaN for a row that holds NaN (masking leaves it whole: its pass gives NaN);
    the support's columns [C, k] (V: padding) where top-k's candidates hold all of it on one process (no tie at the
    k-th beyond them; one host read), else None. On shards top-p needs top_k (its candidates; the engine checks).
    `scratch`: top-p's scan (None: it sorts the rows)."""
    top = rows.max(z.amax(-1, keepdim=True))  # [C, 1]
    theta = z.new_full((z.shape[0], 1), -math.inf)
    if replay.min_p > 0.0:  # q_v ≥ min_p · max q  ⟺  z_v ≥ max z + log min_p
        theta = top + math.log(replay.min_p)
    candidates = columns = None
    k = replay.top_k
    if 0 < k < rows.vocab:  # the k-th largest of all z: min-p keeps a prefix of the sorted z, so max(θ, it) is exact
        # [C, k + 1], descending: the (k + 1)-th tells a tie at the k-th
        candidates, columns = z.topk(k + 1, dim=-1) if rows.group is None else (rows.top(z, k + 1), None)
        theta = torch.maximum(theta, candidates[:, k - 1 : k])
    if replay.top_p < 1.0:
        if candidates is None and scratch is not None and rows.group is None and not _no_host_read(z):
            cut = top_p_scan(z, replay.top_p, theta, top, scratch)
        else:
            cut = _top_p_cut(z, replay.top_p, theta, candidates, k, rows)
        theta = torch.maximum(theta, cut)
    theta.masked_fill_(top.isnan(), math.nan)
    if columns is not None and (_no_host_read(z) or not bool((candidates[:, k:] < theta).all())):  # NaN θ too
        columns = None
    return theta, None if columns is None else columns[:, :k].masked_fill(candidates[:, :k] < theta, rows.vocab)


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
    mass = scratch.get("temp", C).copy_(finite)  # [C, V]: exp(z − top) over {z ≥ θ}, else 0
    if bool((theta > -math.inf).any()):
        fill_below_(mass, theta)
    mass.sub_(safe_top).exp_()
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
    """logsumexp of each row of z [C, V], [C]: max − the largest log_softmax (a log-prob in [−log V, 0], exact to
    rounding), through `out` [C, V]: on CPU a fused log_softmax and `amax` are faster than logsumexp and `max`."""
    top = z.amax(dim=-1, keepdim=True)  # [C, 1]
    lse = top - torch.log_softmax(z, dim=-1, out=out).amax(dim=-1, keepdim=True)  # [C, 1]
    return torch.where(top == -math.inf, top, lse)[:, 0]  # a row of -inf: -inf


def mask_window_(z: Tensor, targets: Tensor, *, replay: Replay, ids: Tensor | None, theta: Tensor | None,
                 rows: RowReduce, owned: Tensor | None = None, scratch: Scratch | None = None,
                 with_lse: bool = False):  # fmt: skip
    """Set z [C, V] to -inf outside support ∪ {target} in place, or (one process, columns known) gather the support
    into narrow rows, z left whole (targets [C, 1] inside [0, V); ids [C, K] the kept ids, or θ [C, 1] from
    `rule_support`, computed when None), a window of `window_rows` rows at a time through `scratch`'s "temp" buffer.
    On a shard, `owned` [C] says which rows' target is this shard's (the others' stand-in column is not kept for
    them). Returns (the lse over its columns [C] with `with_lse`, else None; target outside [C] bool (owned rows
    only); θ; the narrow rows or None)."""
    C, V = z.shape
    target_z = z.gather(1, targets)  # [C, 1]
    lse_full = z.new_empty(C) if with_lse else None
    thetas = [] if ids is None and theta is None else None
    pieces = [] if owned is None and rows.group is None else None  # each window's support columns, while known
    step = window_rows(rows.vocab, C)
    for start in range(0, C, step):
        part = z[start : start + step]  # [c, V], every rank of a shard's group runs the same windows
        if with_lse:
            lse_full[start : start + step] = _row_lse(part, scratch.get("temp", part.shape[0]))
        if ids is not None:
            if pieces is not None:
                pieces.append(narrow_rows.kept_columns(ids[start : start + step], V))
            else:
                keep_ids_(part, ids[start : start + step])
            continue
        part_theta, columns = (None, None) if theta is None else (theta[start : start + step], None)
        if thetas is not None:
            part_theta, columns = rule_support(part, replay, rows, scratch)
            thetas.append(part_theta)
        if pieces is not None:
            if columns is not None:
                pieces.append(columns)
                continue
            pieces = None  # no columns (a tie beyond top-k's candidates, or none asked): the windows before masked too
            fill_below_(z[:start], (torch.cat(thetas) if thetas is not None else theta)[:start])
        fill_below_(part, part_theta)
    theta = torch.cat(thetas) if thetas is not None else theta
    outside = ~(ids == targets).any(-1) if ids is not None else (target_z < theta)[:, 0]  # [C]
    if pieces is not None:
        return lse_full, outside, theta, narrow_rows.narrow(z, targets, torch.cat(pieces))
    if owned is not None:
        outside &= owned
        target_z = torch.where(owned[:, None], target_z, z.gather(1, targets))
    z.scatter_(1, targets, target_z)
    return lse_full, outside, theta, None


@dataclass
class Window:
    """One window of a replayed pass: the transformed logits z [C, V] (the logits' own buffer, or a view of the
    scratch), masked or (`narrow`) left whole, the full lse, the outside flags and the rule's θ (None for kept ids)."""

    z: Tensor
    lse_full: Tensor | None
    outside: Tensor
    theta: Tensor | None
    narrow: Narrow | None = None


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
    lse_full, outside, theta, narrow = mask_window_(
        z, safe, replay=opts.replay, ids=ids, theta=theta, rows=rows, owned=owned, scratch=scratch, with_lse=forward
    )
    return Window(z, lse_full, outside, theta, narrow)


def window_forward(kernels, window: Window, targets: Tensor, mask: Tensor, with_entropy: bool, stats: tuple,
                   truncates: bool = True):  # fmt: skip
    """The backend's plain pass over the masked window: (logp, lse of the support, entropy or None, the statistics
    by name), [C] each; masked rows 0 (False). Without truncation the log kept mass is 0 exactly."""
    z, targets = (window.z, targets) if window.narrow is None else (window.narrow.z, window.narrow.targets)
    logp, lse, entropy, kernel_stats = kernels.token_logprobs_fwd(
        VocabPassArgs(
            logits=z[None],
            targets=targets[None],
            mask=mask[None],
            with_entropy=with_entropy,
            stats=tuple(s for s in stats if s not in REPLAY_STATS),
        )
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


@dataclass(frozen=True, kw_only=True)
class WindowGrads(RowGrads):
    """What the backward of a window's rows reads, [C] each (a fused lm_head chunk's: [1, C]): the targets (inside
    [0, V)), the kept rows, and the backend's `RowGrads` (the lse of the support, the entropy and upstream
    gradients)."""

    targets: Tensor
    mask: Tensor

    def at(self, rows: slice | int | None) -> WindowGrads:
        """`RowGrads.at`, kept in this module: a replayed backward takes one per window, and its path stays here."""
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        return WindowGrads(**{field: pick(getattr(self, field)) for field in self.__dataclass_fields__})


def window_grad_(kernels, window: Window, x: Tensor, grads: WindowGrads, opts: PassOptions, scratch: Scratch,
                 foreign: Tensor | None = None) -> Tensor:  # fmt: skip
    """dL/dx [C, V] (in the window's buffer) of the masked window's logp / entropy: the backend's backward on z in
    place, then the transform's chain rule (`transform.chain_rule_`). Outside the support 0. On a vocabulary shard
    `foreign` [C] is the one-hot the backward put in column 0 for rows whose target another shard owns
    (`parallel.remove_foreign_onehot`), taken back out before the chain rule."""
    part = window.narrow
    z, rows = (window.z if part is None else part.z)[None], grads.at(None)  # [1, C, V or K + 1], [1, C] each
    targets = rows.targets if part is None else part.targets[None]
    kernels.token_logprobs_bwd(VocabPassArgs(logits=z, targets=targets, mask=rows.mask), rows, z)
    grad = window.z if part is None else narrow_rows.scatter_grad_(z[0], part, window.z)
    if foreign is not None:
        grad[:, 0].sub_(foreign.to(grad.dtype))
    if not _transforms(opts):
        return grad
    cap = opts.final_logit_softcapping
    buffer = None if cap is None else scratch.get("temp", x.shape[0])  # sech², soft-capped only
    return chain_rule_(
        grad, x, mask=grads.mask, temperature=opts.temperature, logit_scale=opts.logit_scale, softcap=cap, buffer=buffer
    )


class _Replayed:
    """What both replayed passes share: the rows' targets and owner flags (a shard's, from the pass's
    `parallel.Placement`), how a row's values combine over the shards (`RowReduce`) and the compute-dtype scratch;
    a window of rows masked to the support."""

    def __init__(self, opts: PassOptions, place, vocab: int, rows: int, like: Tensor):
        """`vocab` the local columns, `rows` the scratch's, `like` a tensor of the pass's dtype and device."""
        self.opts, self.shard = opts, place.shard
        self.targets, self.mask = place.targets.reshape(-1), place.mask
        self.owned = None if place.owned is None else place.owned.reshape(-1)
        self.reduce = RowReduce(vocab) if self.shard is None else RowReduce(self.shard.vocab, self.shard.group)
        self.scratch = Scratch(rows, vocab, like.dtype, like.device)

    def _window(self, x: Tensor, rows: slice, theta: Tensor | None, forward: bool, in_place: bool = False) -> Window:
        """The logits x [C, V] of `rows` masked to the support ∪ {target} (θ [C, 1] from the forward, or None)."""
        ids = row_ids(self.opts.replay, rows)
        if ids is not None and self.shard is not None:  # the shard's columns; ids elsewhere dropped
            ids = ids - self.shard.start
        owned = None if self.owned is None else self.owned[rows]
        return masked_window(
            x,
            self.targets[rows],
            ids=ids,
            theta=theta,
            opts=self.opts,
            scratch=self.scratch,
            rows=self.reduce,
            owned=owned,
            forward=forward,
            in_place=in_place,
        )


class ReplayedChunks(_Replayed):
    """Sampling replay on the fused lm_head's chunks of at most `rows` rows: each chunk's logits masked to the
    support (in their own buffer where `masks_in_place`, else in the compute-dtype scratch), the support merged over
    a vocabulary shard's group (`place`, a `parallel.Placement`). The forward keeps each row's θ and, with the whole
    distribution's entropy (`Replay.full_entropy`, one process), that ordinary pass's lse; the backward (`saved`
    those) masks each chunk again from them."""

    def __init__(self, opts: PassOptions, place, rows: int, weight: Tensor, saved=(None, None)):
        super().__init__(opts, place, weight.shape[0], rows, weight)
        self.thetas, self.full_lses = saved
        self._kept: tuple[list[Tensor], list[Tensor]] = ([], [])

    def forward(self, kernels, z: Tensor, r: slice, mask: Tensor):
        """The replayed pass over one chunk z [1, c, V] (mask [1, c], `r` its rows): (logp, lse of the support,
        entropy or None, {statistic}, state), [1, c] each; the statistics those of `opts.stats` on one process, a
        shard's "lse_full" and "outside" for `parallel.merge_replay`. The entropy is the support's, or with
        `Replay.full_entropy` the whole distribution's."""
        opts, replay = self.opts, self.opts.replay
        full = replay.full_entropy and opts.with_entropy
        window = self._window(z[0], r, None, True, masks_in_place(z[0], opts))
        local = opts.stats if self.shard is None else ()
        logp, lse, entropy, stats = window_forward(
            kernels,
            window,
            self.targets[r],
            mask[0],
            opts.with_entropy and not full,
            local,
            replay.truncates(self.reduce.vocab),
        )
        if self.shard is not None:
            stats = {"lse_full": window.lse_full, "outside": window.outside}
        entropy, full_lse = None if entropy is None else entropy[None], None
        if full:  # the ordinary pass for the entropy
            _, full_lse, entropy, _ = kernels.token_logprobs_fwd(
                VocabPassArgs(
                    logits=z,
                    targets=self.targets[None, r],
                    mask=mask,
                    **{**opts.pass_fields, "with_entropy": True, "stats": ()},
                )
            )
            self._kept[1].append(full_lse)
        if window.theta is not None:
            self._kept[0].append(window.theta)
        return logp[None], lse[None], entropy, {name: x[None] for name, x in stats.items()}, (window, full_lse)

    def saved(self) -> tuple[Tensor | None, Tensor | None]:
        """Each row's θ [M, 1] (None for kept ids) and the full pass's lse [1, M] (None without it)."""
        thetas, full_lses = self._kept
        return (torch.cat(thetas) if thetas else None), (torch.cat(full_lses, 1) if full_lses else None)

    def grad(
        self, kernels, z: Tensor, r: slice, grads: WindowGrads, state=None, foreign: Tensor | None = None
    ) -> Tensor:
        """dL/dlogits [c, V] (compute dtype, in the chunk's buffer or the scratch) of one chunk z [1, c, V], from its
        forward's `state`, or (None) masked again from the saved θ; z is overwritten with the full entropy's
        gradient when that is asked. `grads` its rows' [c]; `foreign` as `window_grad_`'s."""
        if state is None:
            theta = None if self.thetas is None else self.thetas[r]
            full_lse = None if self.full_lses is None else self.full_lses[:, r]
            state = (self._window(z[0], r, theta, False, masks_in_place(z[0], self.opts)), full_lse)
        window, full_lse = state
        full = full_lse is not None
        support = WindowGrads(targets=grads.targets, mask=grads.mask, lse=grads.lse, grad_logp=grads.grad_logp)
        grad = window_grad_(kernels, window, z[0], support if full else grads, self.opts, self.scratch, foreign)
        if full and grads.grad_entropy is not None:
            entropy_grads = RowGrads(lse=full_lse, entropy=grads.entropy[None], grad_entropy=grads.grad_entropy[None])
            args = VocabPassArgs(logits=z, targets=grads.targets[None], mask=grads.mask[None], **self.opts.pass_fields)
            kernels.token_logprobs_bwd(args, entropy_grads, z)
            grad.add_(z[0])
        return grad


class ReplayedRows(_Replayed):
    """A replayed pass over logits [B, T, V] (a vocabulary shard's [B, T, V_r]), a window of rows at a time through
    one compute-dtype scratch (never [B·T, V]): the flattened rows' targets, mask and owner flags from the pass's
    `parallel.Placement`, and how a row's values combine over the shards (`RowReduce`). Windows are sized by the
    whole vocabulary, so every rank of a shard's group runs the same windows."""

    def __init__(self, logits: Tensor, place, opts: PassOptions):
        rows = window_rows(place.shard.vocab if place.shard is not None else logits.shape[-1], place.mask.numel())
        super().__init__(opts, place, logits.shape[-1], rows, logits)
        self.logits, self.mask = logits, self.mask.reshape(-1)

    def _windows(self):
        """(rows, x) per window of at most the scratch's rows: `rows` the slice of the flattened [B·T] rows, x [C, V]
        a view (windows never cross a sequence unless the logits flatten)."""
        B, T, V = self.logits.shape
        step = self.scratch.shape[0]
        try:
            flat = self.logits.view(-1, V)
        except RuntimeError:
            flat = None
        if flat is not None:
            for start in range(0, B * T, step):
                yield slice(start, min(start + step, B * T)), flat[start : start + step]
            return
        for b in range(B):
            for start in range(0, T, step):
                stop = min(start + step, T)
                yield slice(b * T + start, b * T + stop), self.logits[b, start:stop]

    def forward(self, kernels):
        """(logp, lse of the support, entropy or None, {statistic}, θ [B·T] (empty for kept ids)), per-row values
        [B, T]. One process: the statistics of `opts.stats`; a shard: its "lse_full" and "outside" for
        `parallel.merge_replay`."""
        opts, (B, T, _) = self.opts, self.logits.shape
        dtype, device, n = compute_dtype(self.logits.dtype), self.logits.device, B * T
        names = ("logp", "lse", "lse_full", *(("entropy",) if opts.with_entropy else ()))
        out = {name: torch.zeros(n, dtype=dtype, device=device) for name in names}  # [B·T] each
        out["outside"] = torch.zeros(n, dtype=torch.bool, device=device)
        local = opts.stats if self.shard is None else ()  # a shard's are merged once every window's are in
        stats = {
            name: torch.zeros(n, dtype=torch.bool if name == "outside_support" else dtype, device=device)
            for name in local
        }
        theta = torch.empty(n if opts.replay.kept_ids is None else 0, dtype=dtype, device=device)
        truncates = opts.replay.truncates(self.reduce.vocab)
        for rows, x in self._windows():
            window = self._window(x, rows, None, True)
            found = window_forward(
                kernels, window, self.targets[rows], self.mask[rows], opts.with_entropy, local, truncates
            )
            out["logp"][rows], out["lse"][rows] = found[0], found[1]
            out["lse_full"][rows], out["outside"][rows] = window.lse_full, window.outside
            if opts.with_entropy:
                out["entropy"][rows] = found[2]
            for name, x in found[3].items():
                stats[name][rows] = x
            if window.theta is not None:
                theta[rows] = window.theta[:, 0]
        if self.shard is not None:
            stats = {"lse_full": out["lse_full"], "outside": out["outside"]}
        view = lambda x: x.view(B, T)  # noqa: E731
        entropy = out.get("entropy")
        stats = {name: view(x) for name, x in stats.items()}
        return view(out["logp"]), view(out["lse"]), None if entropy is None else view(entropy), stats, theta

    def backward(
        self,
        kernels,
        out: Tensor,
        *,
        lse: Tensor,
        entropy: Tensor | None,
        grad_logp: Tensor | None,
        grad_entropy: Tensor | None,
        theta: Tensor,
    ) -> None:
        """dL/dlogits into `out` [B, T, V] (the logits themselves for the in-place backward), window by window from
        each row's saved θ (or the kept ids); `lse`, `entropy`, the upstream gradients [B, T] (None: not taken)."""
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        g = flat(grad_logp)
        grads = WindowGrads(
            targets=self.targets,
            mask=self.mask,
            lse=flat(lse),
            entropy=flat(entropy),
            grad_logp=g,
            grad_entropy=flat(grad_entropy),
        )
        B, T, V = out.shape
        for rows, x in self._windows():
            window = self._window(x, rows, None if theta.numel() == 0 else theta[rows, None], forward=False)
            foreign = None
            if self.owned is not None and g is not None:  # the one-hot of rows whose target another shard owns
                foreign = torch.where(self.owned[rows] | ~self.mask[rows], 0.0, g[rows])
            grad = window_grad_(kernels, window, x, grads.at(rows), self.opts, self.scratch, foreign)
            try:
                target = out.view(-1, V)[rows]
            except RuntimeError:
                b, start = divmod(rows.start, T)
                target = out[b, start : start + rows.stop - rows.start]
            target.copy_(grad)

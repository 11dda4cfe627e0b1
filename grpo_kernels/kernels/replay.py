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

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.function import (
    backend_kernels,
    check_not_overwritten,
    checked_rows,
    consume,
    in_place_or_new,
    mark_overwritten,
)
from grpo_kernels.kernels.function import vocab_pass as function_vocab_pass
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.torch.token_logprobs import transform_

REPLAY_STATS = ("log_kept_mass", "outside_support")  # per-token statistics of a replayed pass (float32, bool)
WINDOW_ELEMENTS = 1 << 20  # logits per scratch window (4 MiB of float32)


@dataclass(frozen=True, eq=False)
class Replay:
    """The sampler's support to replay: its rule (top_k 0, top_p 1.0, min_p 0.0: off) or its kept ids per row
    (`kept_ids` [rows, K] int64, -1 padding, rows in the pass's flattened order); `full_entropy`: the entropy of
    the whole distribution instead of the support's. With every rule off and no ids it only reports: log kept mass
    0, no target outside."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    kept_ids: Tensor | None = None
    full_entropy: bool = False

    def truncates(self, vocab: int) -> bool:
        """Whether the support can be smaller than the vocabulary."""
        return self.kept_ids is not None or 0 < self.top_k < vocab or self.top_p < 1.0 or self.min_p > 0.0


def thresholds(z: Tensor, replay: Replay) -> Tensor:
    """θ [C, 1] per row of the transformed window z [C, V] such that the rule's support is {z ≥ θ}."""
    V = z.shape[-1]
    theta = z.new_full((z.shape[0], 1), -math.inf)
    if replay.min_p > 0.0:  # q_v ≥ min_p · max q  ⟺  z_v ≥ max z + log min_p
        theta = z.amax(-1, keepdim=True) + math.log(replay.min_p)
    candidates = None
    if 0 < replay.top_k < V:  # the k-th largest of all z: min-p keeps a prefix of the sorted z, so max(θ, it) is exact
        candidates = z.topk(replay.top_k, dim=-1).values  # [C, k], descending
        theta = torch.maximum(theta, candidates[:, -1:])
    if replay.top_p < 1.0:
        if candidates is None:
            candidates = z.sort(dim=-1, descending=True).values  # [C, V]
        kept = candidates >= theta  # [C, K]
        # the kept mass over the whole row: ties at the k-th value beyond the k candidates count too
        lse_kept = torch.where(z >= theta, z, -math.inf).logsumexp(-1, keepdim=True)  # [C, 1]
        q = (candidates - lse_kept).exp_().masked_fill_(~kept, 0.0)  # [C, K]
        before = q.cumsum(-1).sub_(q)  # [C, K]: the mass ahead of each candidate
        cut = candidates.masked_fill(~(before < replay.top_p) | ~kept, math.inf).amin(-1, keepdim=True)  # [C, 1]
        theta = torch.maximum(theta, cut)
    return theta


def mask_window_(z: Tensor, targets: Tensor, replay: Replay, ids: Tensor | None, theta: Tensor | None):
    """Set z [C, V] to -inf outside support ∪ {target} in place (targets [C, 1] inside [0, V); ids [C, K] the kept
    ids, or θ [C, 1] from `thresholds`, computed when None). Returns (the full lse [C], target outside [C] bool, θ)."""
    lse_full = torch.logsumexp(z, dim=-1)  # [C]
    target_z = z.gather(1, targets)  # [C, 1]
    if ids is not None:
        V = z.shape[-1]
        keep = torch.zeros(z.shape[0], V + 1, dtype=torch.bool, device=z.device)  # [C, V + 1]: column V takes -1
        keep.scatter_(1, ids.masked_fill(ids < 0, V), True)
        drop = ~keep[:, :V]  # [C, V]
    else:
        if theta is None:
            theta = thresholds(z, replay)
        drop = z < theta  # [C, V]
    outside = drop.gather(1, targets)[:, 0]  # [C]
    z.masked_fill_(drop, -math.inf).scatter_(1, targets, target_z)
    return lse_full, outside, theta


@dataclass
class Window:
    """One window of a replayed pass: the masked transformed logits z [C, V] (a view of the scratch buffer), the
    full lse, the outside flags and the rule's θ (None for kept ids)."""

    z: Tensor
    lse_full: Tensor
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


def masked_window(x: Tensor, targets: Tensor, replay: Replay, ids, theta, opts, scratch: Scratch) -> Window:
    """x [C, V] logits rows (any dtype) copied into scratch, transformed (`opts.transform`, `opts.temperature`) and
    masked to the support ∪ {target}; targets [C]."""
    z = scratch.get("z", x.shape[0]).copy_(x)
    transform_(z, opts.temperature, opts.logit_scale, opts.final_logit_softcapping)
    safe = targets.clamp(0, x.shape[-1] - 1).reshape(-1, 1)  # masked rows may hold any id
    lse_full, outside, theta = mask_window_(z, safe, replay, ids, theta)
    return Window(z, lse_full, outside, theta)


def window_forward(kernels, window: Window, targets: Tensor, mask: Tensor, with_entropy: bool, stats: tuple,
                   truncates: bool = True):  # fmt: skip
    """The backend's plain pass over the masked window: (logp, lse of the support, entropy or None, the statistics
    by name), [C] each; masked rows 0 (False). Without truncation the log kept mass is 0 exactly."""
    logp, lse, entropy, kernel_stats = kernels.token_logprobs_fwd(
        window.z[None], targets[None], mask[None], 1.0, with_entropy, stats=tuple(s for s in stats if s not in REPLAY_STATS)
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
                 scratch: Scratch) -> Tensor:  # fmt: skip
    """dL/dx [C, V] (in the window's scratch) of the masked window's logp / entropy: the backend's backward on z in
    place, then the transform's chain rule dz/dx = s/T, or s/T·sech²(s·x/c) soft-capped. Outside the support 0."""
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
    slope = opts.logit_scale / opts.temperature
    cap = opts.final_logit_softcapping
    if cap is not None:  # masked rows may hold NaN logits: their 0 stays 0
        sech2 = scratch.get("slope", x.shape[0]).copy_(x).mul_(opts.logit_scale / cap)
        grad.mul_(sech2.cosh_().square_().reciprocal_().mul_(slope))  # 1/cosh², not 1 − tanh² (cancels near ±1)
        grad.masked_fill_(~mask[:, None], 0.0)
    elif slope != 1.0:
        grad.mul_(slope)
    return grad


def _windows(logits: Tensor, step: int):
    """(rows, x) per window of at most `step` consecutive rows of logits [B, T, V]: `rows` the slice of the
    flattened [B·T] rows, x [C, V] a view (windows never cross a sequence unless the logits flatten)."""
    B, T, V = logits.shape
    try:
        flat = logits.view(-1, V)
    except RuntimeError:
        flat = None
    if flat is not None:
        for start in range(0, B * T, step):
            yield slice(start, min(start + step, B * T)), flat[start : start + step]
        return
    for b in range(B):
        for start in range(0, T, step):
            stop = min(start + step, T)
            yield slice(b * T + start, b * T + stop), logits[b, start:stop]


def _at(x: Tensor, rows: slice) -> Tensor:
    """The window of x [B, T, V] at the flattened `rows` (inside one sequence unless x flattens), [C, V]."""
    B, T, V = x.shape
    try:
        return x.view(-1, V)[rows]
    except RuntimeError:
        b, start = divmod(rows.start, T)
        return x[b, start : start + rows.stop - rows.start]


def _ids(replay: Replay, rows: slice) -> Tensor | None:
    return None if replay.kept_ids is None else replay.kept_ids[rows]


def _full_pass_options(opts: PassOptions) -> PassOptions:
    """The ordinary pass beside a replayed one (the full distribution's entropy): no replay, no statistics, never
    in place (two backward passes read the logits)."""
    return PassOptions(
        backend=opts.backend,
        temperature=opts.temperature,
        with_entropy=True,
        logit_scale=opts.logit_scale,
        final_logit_softcapping=opts.final_logit_softcapping,
        inplace=False,
    )


class _ReplayLogprobsFunction(torch.autograd.Function):
    """logits [B, T, V] -> (logp [B, T], entropy [B, T] or empty, *the asked statistics) over the replayed support,
    a window of rows at a time; saves O(B·T) statistics and each row's θ, never [B, T, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions):
        check_not_overwritten(logits)
        logp, lse, entropy, stats, theta = _replay_forward(logits, targets, mask, opts)
        entropy = logp.new_empty(0) if entropy is None else entropy
        ctx.mark_non_differentiable(*stats, *([] if opts.with_entropy else [entropy]))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, mask, lse, entropy, theta)
        ctx.opts = opts
        ctx.consumed = False
        return logp, entropy, *stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_stats):
        opts: PassOptions = ctx.opts
        consume(ctx)
        logits, targets, mask, lse, entropy, theta = ctx.saved_tensors
        if not opts.with_entropy:
            grad_entropy = None
        version = logits._version
        out = in_place_or_new(ctx, logits)
        kernels = backend_kernels(opts.backend)
        B, T, V = logits.shape
        scratch = Scratch(window_rows(V, B * T), V, logits.dtype, logits.device)
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        targets, mask, lse, g, g_h = flat(targets), flat(mask), flat(lse), flat(grad_logp), flat(grad_entropy)
        entropy = flat(entropy) if grad_entropy is not None else None
        backends.count_launch(opts.backend)
        for rows, x in _windows(logits, scratch.shape[0]):
            theta_rows = None if theta.numel() == 0 else theta[rows, None]
            window = masked_window(x, targets[rows], opts.replay, _ids(opts.replay, rows), theta_rows, opts, scratch)
            grad = window_grad_(
                kernels,
                window,
                x,
                targets[rows],
                mask[rows],
                lse[rows],
                None if entropy is None else entropy[rows],
                None if g is None else g[rows],
                None if g_h is None else g_h[rows],
                opts,
                scratch,
            )
            _at(out, rows).copy_(grad)
        mark_overwritten(ctx, logits, version)
        return out, None, None, None


def _replay_forward(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions):
    """The replayed pass, window by window: logp, lse (support), entropy or None, [statistics], θ (or empty)."""
    replay: Replay = opts.replay
    kernels = backend_kernels(opts.backend)
    B, T, V = logits.shape
    dtype = compute_dtype(logits.dtype)
    scratch = Scratch(window_rows(V, B * T), V, logits.dtype, logits.device)
    flat_targets, flat_mask = targets.reshape(-1), mask.reshape(-1)
    logp, lse = (torch.zeros(B * T, dtype=dtype, device=logits.device) for _ in range(2))
    entropy = torch.zeros_like(logp) if opts.with_entropy else None
    stats = {
        name: torch.zeros(B * T, dtype=torch.bool if name in ("is_top1", "outside_support") else dtype,
                          device=logits.device)
        for name in opts.stats
    }  # fmt: skip
    theta = torch.empty(B * T if replay.kept_ids is None else 0, dtype=dtype, device=logits.device)
    backends.count_launch(opts.backend)
    for rows, x in _windows(logits, scratch.shape[0]):
        window = masked_window(x, flat_targets[rows], replay, _ids(replay, rows), None, opts, scratch)
        found = window_forward(
            kernels, window, flat_targets[rows], flat_mask[rows], opts.with_entropy, opts.stats, replay.truncates(V)
        )
        logp[rows], lse[rows] = found[0], found[1]
        if entropy is not None:
            entropy[rows] = found[2]
        for name, x in found[3].items():
            stats[name][rows] = x
        if window.theta is not None:
            theta[rows] = window.theta[:, 0]
    logp = checked_rows(opts.row_check, lse.view(B, T), logp.view(B, T), None)
    entropy = None if entropy is None else entropy.view(B, T)
    return logp, lse.view(B, T), entropy, [stats[name].view(B, T) for name in opts.stats], theta


def vocab_pass(logits: Tensor, targets: Tensor, mask: Tensor, opts: PassOptions) -> dict[str, Tensor]:
    """`function.vocab_pass` over the replayed support (`opts.replay`): {"logp", "entropy" (if asked; the support's,
    or the whole distribution's with `Replay.full_entropy`), each of `opts.stats`}, all [B, T]."""
    replay: Replay = opts.replay
    full = replay.full_entropy and opts.with_entropy
    if full:  # the entropy from an ordinary pass beside the replayed one
        from_full = function_vocab_pass(logits, targets, mask, _full_pass_options(opts))
        opts = dataclasses.replace(opts, with_entropy=False, inplace=False)
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, entropy, *stats = _ReplayLogprobsFunction.apply(logits, targets, mask, opts)
    else:
        logp, _, entropy, stats, _ = _replay_forward(logits, targets, mask, opts)
    out = {"logp": logp} | ({"entropy": entropy} if opts.with_entropy else {})
    if full:
        out["entropy"] = from_full["entropy"]
    return out | dict(zip(opts.stats, stats, strict=True))


def chunk_state(z: Tensor, targets: Tensor, opts: PassOptions, rows: slice, scratch: Scratch, theta: Tensor | None,
                full_lse: Tensor | None) -> ChunkState:  # fmt: skip
    """A chunk's state for `chunk_grad` again, in the backward: its window masked from the saved θ [c, 1] (or the
    kept ids), and the full pass's saved lse [1, c] (or None)."""
    window = masked_window(z[0], targets[0], opts.replay, _ids(opts.replay, rows), theta, opts, scratch)
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
    window = masked_window(z[0], targets[0], replay, _ids(replay, rows), theta, opts, scratch)
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

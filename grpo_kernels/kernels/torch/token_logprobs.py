"""Vocabulary pass in chunked PyTorch: the CPU path, and the reference layout of the Triton kernels.

The logits are read a window of consecutive rows at a time (windows without a kept row are skipped), so no
[N, V] float32 tensor ever exists. Each window is computed in place or in scratch buffers allocated once per
call: on CPU a fresh multi-MiB tensor per chunk pays its page faults again each time (log_softmax over
[512, 151936] float32 took 4× longer into new memory than into a reused buffer), and a cache-sized window is
faster still.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs, compute_dtype
from grpo_kernels.kernels.transform import transform_

CHUNK_ELEMENTS = {"cpu": 1 << 20, "other": 1 << 22}  # logits per chunk: 4 MiB of float32 (cache-sized) on CPU
LSE_FROM_TARGET = 32.0  # lse = z_t − log q_t for log q_t > −32 (rounding ≤ ulp(32)); logsumexp for the rest


def _chunk_rows(logits: Tensor) -> int:
    budget = CHUNK_ELEMENTS["cpu" if logits.device.type == "cpu" else "other"]
    return max(1, budget // logits.shape[-1])


def _flat(x: Tensor) -> Tensor | None:
    """x [B, T, ...] as a [B·T, ...] view, or None when its strides allow no such view."""
    try:
        return x.view(-1, *x.shape[2:])
    except RuntimeError:
        return None


def _windows(logits: Tensor, mask: Tensor):
    """Yield (rows, z) per window of consecutive rows that holds a kept row (a call of one window: that window):
    `rows` selects the window in the flattened [B·T] statistics and `z` [C, V] is a view of its logits. Never a
    gather (CPU index_select runs at a fraction of copy bandwidth): the masked rows inside a window are computed,
    and the callers zero them."""
    step = _chunk_rows(logits)
    flat = _flat(logits)
    if flat is not None and flat.shape[0] <= step:  # one window of every row: no test of the mask (a host read)
        yield slice(0, flat.shape[0]), flat
        return
    lines = flat[None] if flat is not None else logits  # [L, S, V]: windows never cross a line
    L, S = lines.shape[:2]
    if S <= step:  # one window per line
        kept = mask.reshape(L, S).any(-1, keepdim=True)  # [L, 1]
    else:
        kept = torch.nn.functional.pad(mask.reshape(L, S), (0, -S % step)).view(L, -1, step).any(-1)  # [L, windows]
    for line, window in kept.nonzero().tolist():
        start = window * step
        stop = min(start + step, S)
        yield slice(line * S + start, line * S + stop), lines[line, start:stop]


def _rows(x: Tensor, rows: slice) -> Tensor:
    """x[rows] (x itself for a slice of all its rows: at small shapes even a view op counts)."""
    return x if rows.start == 0 and rows.stop == x.shape[0] else x[rows]


def _head(buffer: Tensor, z: Tensor) -> Tensor:
    """The rows of a scratch buffer that the window z [C, V] fills (all of it for a call of one window)."""
    return _rows(buffer, slice(0, z.shape[0]))


def _one_window(windows: list[tuple[slice, Tensor]], rows: int) -> bool:
    """Whether `_windows` gave one window of every row: a small call, whose window results are the outputs."""
    return len(windows) == 1 and windows[0][0] == slice(0, rows)


def _kept_targets(targets: Tensor, vocab: int) -> Tensor:
    """targets [B, T] as [B·T, 1] ids inside [0, V): windows read the masked rows too, and padding ids there (-100,
    or ≥ V) may be anything; kept ids are inside already (checked, or made safe by the engine)."""
    return targets.clamp(0, vocab - 1).reshape(-1, 1)


def _scratch(logits: Tensor) -> Tensor:
    """A [chunk rows, V] buffer in the compute dtype, reused by every window of one call (no more rows than the
    logits have: a small call allocates a small buffer)."""
    rows = min(_chunk_rows(logits), logits.shape[:-1].numel())
    return torch.empty(rows, logits.shape[-1], dtype=compute_dtype(logits.dtype), device=logits.device)


def token_logprobs_fwd(args: VocabPassArgs) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """logp, lse, entropy (or None), each [B, T], and the requested `stats` by name ([B, T] each; `is_top1` bool),
    all of the transformed logits (`transform_`), in the compute dtype. Masked rows get 0 (False)."""
    logits, targets, mask, stats = args.logits, args.targets, args.mask, args.stats
    temperature, logit_scale, softcap, with_entropy = (
        args.temperature,
        args.logit_scale,
        args.softcap,
        args.with_entropy,
    )
    dtype = compute_dtype(logits.dtype)
    flat_targets, dropped = _kept_targets(targets, logits.shape[-1]), ~mask.reshape(-1, 1)  # [B·T, 1] each
    identity = temperature == 1.0 and logit_scale == 1.0 and softcap is None
    transformed = logits.dtype != dtype or not identity
    log_q_buf = _scratch(logits)  # [C, V] each; z_buf only for a transformed copy or q · log q
    z_buf = _scratch(logits) if transformed or with_entropy or "log_sum_sq_probs" in stats else None
    names = ("logp", "lse", *(("entropy",) if with_entropy else ()), *stats)

    def window_stats(rows: slice, z: Tensor) -> dict[str, Tensor]:  # each name's values at the window's rows, [C, 1]
        """Masked rows get 0: they are computed (a window is never a gather) and may hold anything."""
        if transformed:  # [C, V]; the caller's logits are read only
            z = transform_(_head(z_buf, z).copy_(z), temperature, logit_scale, softcap)
        target = _rows(flat_targets, rows)  # [C, 1]
        log_q = torch.log_softmax(z, dim=-1, out=_head(log_q_buf, z))  # [C, V]: one fused pass
        dropped_rows = _rows(dropped, rows)
        logp = log_q.gather(1, target).masked_fill_(dropped_rows, 0)  # [C, 1]
        found = {"logp": logp, "lse": (z.gather(1, target) - logp).masked_fill_(dropped_rows, 0)}  # [C, 1]
        # lse = z_target − log q_target is as exact as lse itself while log q_target is small: recompute the others
        if torch.compiler.is_compiling():  # no host read in a graph: every row's logsumexp, taken where needed
            likely = logp > -LSE_FROM_TARGET  # [C, 1]; NaN too; masked rows are 0
            found["lse"] = torch.where(likely, found["lse"], torch.logsumexp(z, dim=-1, keepdim=True))
        elif not bool((logp > -LSE_FROM_TARGET).all()):  # NaN too; masked rows are 0
            unlikely = ~(logp > -LSE_FROM_TARGET)[:, 0]
            found["lse"][unlikely] = torch.logsumexp(z[unlikely], dim=-1, keepdim=True)
        more = {}  # the other statistics
        if "mean_logits" in stats:
            more["mean_logits"] = z.sum(-1, keepdim=True) / z.shape[-1]
        if "is_top1" in stats:  # argmax gives the first maximum: a tie with an earlier token is not a top-1
            more["is_top1"] = z.argmax(-1, keepdim=True) == target
        if with_entropy:  # H = −Σ q log q, with 0 · log 0 = 0 for -inf logits (the NaN of 0 · −inf)
            q_log_q = torch.exp(log_q, out=_head(z_buf, z)).mul_(log_q).nan_to_num_(nan=0.0)  # [C, V]
            more["entropy"] = -q_log_q.sum(-1, keepdim=True)
        if "log_sum_sq_probs" in stats:  # log Σ q²: Σ q² ≥ 1/V, so squaring in the compute dtype loses nothing
            more["log_sum_sq_probs"] = torch.exp(log_q, out=_head(z_buf, z)).square_().sum(-1, keepdim=True).log_()
        for x in more.values():
            x.masked_fill_(dropped_rows, 0)
        return found | more

    windows = list(_windows(logits, mask))
    if _one_window(windows, dropped.shape[0]):
        out = {name: x.view(mask.shape) for name, x in window_stats(*windows[0]).items()}
    else:
        out = {
            name: torch.zeros(mask.shape, dtype=torch.bool if name == "is_top1" else dtype, device=logits.device)
            for name in names
        }  # [B, T] each
        for rows, z in windows:
            for name, x in window_stats(rows, z).items():
                out[name].view(-1, 1)[rows] = x
    return out.pop("logp"), out.pop("lse"), out.pop("entropy", None), out


def token_logprobs_bwd(args: VocabPassArgs, grads: RowGrads, out: Tensor) -> None:
    """Write dL/dlogits into `out` (which may be the logits themselves): per kept row

    (g·(onehot − q) + g_H·(−q·(log q + H)))·dz/dx,  q = softmax(z),  z = transform(x) (`transform_`),
    dz/dx = s/T, or s/T·sech²(s·x/c) when soft-capped;  masked rows get 0.
    When `out` is the logits in float32 (or float64), each window is rewritten in place.
    """
    logits, targets, mask = args.logits, args.targets, args.mask
    temperature, logit_scale, softcap = args.temperature, args.logit_scale, args.softcap
    dtype = compute_dtype(logits.dtype)
    in_place = out is logits and logits.dtype == dtype
    flat = lambda x: None if x is None else x.reshape(-1, 1).to(dtype)  # noqa: E731  [B·T, 1]
    lse, entropy, grad_entropy = flat(grads.lse), flat(grads.entropy), flat(grads.grad_entropy)
    g_all = torch.zeros_like(lse) if grads.grad_logp is None else flat(grads.grad_logp)  # [B·T, 1]
    flat_targets = _kept_targets(targets, logits.shape[-1])  # [B·T, 1]
    log_q_buf = None if in_place else _scratch(logits)  # [C, V]
    out_flat = _flat(out)  # [B·T, V] (out is the logits or a contiguous buffer), or None for strided logits
    q_buf = _scratch(logits) if grad_entropy is not None else None  # [C, V]
    slope_buf = _scratch(logits) if softcap is not None else None  # [C, V]: dz/dx
    slope = logit_scale / temperature  # dz/dx without soft-capping
    windows = list(_windows(logits, mask))
    whole = _one_window(windows, mask.numel())
    for rows, z in windows:
        log_q = z if in_place else _head(log_q_buf, z).copy_(z)  # [C, V], overwritten by the gradient
        if softcap is not None:  # y = s·x/c -> z = c/T·tanh y in log_q, dz/dx = s/T·sech² y in slope_buf
            y = torch.mul(log_q, logit_scale / softcap, out=_head(slope_buf, z))
            torch.tanh(y, out=log_q).mul_(softcap / temperature)
            y.cosh_().square_().reciprocal_().mul_(slope)  # sech² = 1/cosh², not 1 − tanh² (cancels near ±1)
        elif slope != 1.0:
            transform_(log_q, temperature, logit_scale, None)
        log_q.sub_(_rows(lse, rows))
        g = _rows(g_all, rows)  # [C, 1]
        if grad_entropy is None:
            grad = log_q.exp_().mul_(-g)  # [C, V], in the same buffer
        else:
            q = torch.exp(log_q, out=_head(q_buf, z))  # [C, V]
            log_q.add_(_rows(entropy, rows)).mul_(q).masked_fill_(q == 0, 0.0)  # q·(log q + H)
            grad = log_q.mul_(-_rows(grad_entropy, rows)).sub_(q.mul_(g))
        grad.scatter_add_(1, _rows(flat_targets, rows), g)
        if softcap is not None:
            grad.mul_(_head(slope_buf, z))
        elif logit_scale != 1.0:
            grad.mul_(slope)
        elif temperature != 1.0:
            grad.div_(temperature)
        if whole:  # its masked rows are zeroed here, in the window already in cache
            grad.masked_fill_(~mask.reshape(-1, 1), 0.0)
        if not in_place:  # a window never crosses a sequence unless the logits flatten
            T = mask.shape[1]
            line, start = divmod(rows.start, T)
            window = out_flat[rows] if out_flat is not None else out[line, start : start + rows.stop - rows.start]
            window.copy_(grad)
    if not whole:
        out.index_put_((~mask).nonzero(as_tuple=True), out.new_zeros(()))  # only the masked rows are written

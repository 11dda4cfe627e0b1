"""The vocabulary pass on 2-D tiles in PyTorch, for the lean fused lm_head: a tile is the logits of some rows over a
slice [v0, v0 + w) of the vocabulary. The forward folds each tile into running per-row statistics (an online
log-sum-exp across vocabulary tiles); the backward writes dL/dlogits of a tile once every row's lse is known.

The running statistics of a row, relative to a finite reference r (its running max, or 0 while every logit seen is
-inf): M the max, S = Σ e^(z − r), T = Σ e^(z − r)·(z − r) (entropy), SQ = Σ e^(2(z − r)) (log Σ q²), Σ z (mean
logit), the max before / up to the target (top-1) and z at the target. Without entropy and log Σ q², S and T
are not needed: a row keeps its running lse, from one max and one fused log_softmax per window (a third of the
passes of the general fold). A tile is cut into windows of rows so that its float32 scratch stays cache-sized
whatever the tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_kernels.kernels.protocol import RowGrads, compute_dtype
from grpo_kernels.kernels.transform import transform_

WINDOW_ELEMENTS = 1 << 20  # float32 scratch per window: 4 MiB


def _reference(m: Tensor) -> Tensor:
    """A finite reference for statistics relative to the max m: m, or 0 where m = -inf (nothing seen yet)."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


class TileStats:
    """Running statistics of `rows` rows over the vocabulary tiles folded so far (`add`), and the pass's outputs from
    them (`finish`). targets [rows] (absolute ids), mask [rows] bool (False: the row gives 0) or None (all kept)."""

    def __init__(self, targets: Tensor, mask: Tensor | None, dtype: torch.dtype, opts):
        rows, device = targets.shape[0], targets.device
        self.dtype = compute_dtype(dtype)
        self.targets, self.mask, self.opts = targets, mask, opts
        full = lambda value: torch.full((rows,), value, dtype=self.dtype, device=device)  # noqa: E731
        self.m, self.s, self.t, self.sq, self.vsum = full(-float("inf")), full(0.0), full(0.0), full(0.0), full(0.0)
        self.before, self.upto, self.z_t = full(-float("inf")), full(-float("inf")), full(0.0)
        self.lse_only = not opts.with_entropy and "log_sum_sq_probs" not in opts.stats
        self.lse = full(-float("inf"))  # the running lse, when that is all a row keeps
        self.scratch = None

    def _windows(self, x: Tensor):
        """(rows, z) per window of x [c, w]: z the transformed logits in the compute dtype (x itself when nothing
        changes them)."""
        opts = self.opts
        step = max(1, WINDOW_ELEMENTS // max(1, x.shape[1]))
        identity = opts.temperature == 1.0 and opts.logit_scale == 1.0 and opts.final_logit_softcapping is None
        for start in range(0, x.shape[0], step):
            rows = slice(start, min(start + step, x.shape[0]))
            z = x[rows]
            if z.dtype != self.dtype or not identity:
                z = transform_(self._buffer(0, z.shape).copy_(z), opts.temperature, **opts.transform)
            yield rows, z

    def _buffer(self, i: int, shape) -> Tensor:
        """Scratch i (of 2) of `shape`, from buffers allocated once per pass."""
        if self.scratch is None or self.scratch[0].numel() < shape[0] * shape[1]:
            self.scratch = [torch.empty(shape[0] * shape[1], dtype=self.dtype, device=self.m.device) for _ in "ab"]
        return self.scratch[i][: shape[0] * shape[1]].view(shape)

    def add(self, x: Tensor, v0: Tensor | int) -> None:
        """Fold the tile x [rows, w] of logits (the weight's dtype), columns v0 .. v0 + w of the vocabulary."""
        stats = self.opts.stats
        rel = self.targets - v0  # [rows]: the target's column in this tile (outside [0, w) when not in it)
        for rows, z in self._windows(x):
            w = z.shape[1]
            if self.lse_only:
                m, top = z.max(-1)  # [n] each
                log_q = torch.log_softmax(z, -1, out=self._buffer(1, z.shape))  # [n, w]: one fused pass
                lse = m - log_q.gather(1, top[:, None]).squeeze(1)  # m + log Σ e^(z − m), exact at the max
                lse = torch.where(torch.isneginf(m), m, lse)  # a window of -inf logits adds nothing
                self.lse[rows] = torch.logaddexp(self.lse[rows], lse)
                self.m[rows] = torch.maximum(self.m[rows], m)
            else:
                self._fold(rows, z)
            if "mean_logits" in stats:
                self.vsum[rows] += z.sum(-1)
            r = rel[rows]
            inside = (r >= 0) & (r < w)
            z_t = z.gather(1, r.clamp(0, w - 1)[:, None]).squeeze(1)
            self.z_t[rows] = torch.where(inside, z_t, self.z_t[rows])
            if "is_top1" in stats:  # columns before / up to the target (all of a tile before it, none after)
                cols = torch.arange(w, device=z.device)[None]
                ninf = torch.tensor(-float("inf"), dtype=z.dtype, device=z.device)
                self.before[rows] = torch.maximum(self.before[rows], torch.where(cols < r[:, None], z, ninf).amax(-1))
                self.upto[rows] = torch.maximum(self.upto[rows], torch.where(cols <= r[:, None], z, ninf).amax(-1))

    def _fold(self, rows: slice, z: Tensor) -> None:
        """Fold the window z [n, w] into M, S, T, SQ, moved to the new reference."""
        m = z.amax(-1)  # [n]
        ref_m = _reference(m)
        d = torch.sub(z, ref_m[:, None], out=self._buffer(1, z.shape))  # [n, w]: z − r
        e = torch.exp(d)  # [n, w]
        s = e.sum(-1)
        new_m = torch.maximum(self.m[rows], m)
        ref_old, ref_new = _reference(self.m[rows]), _reference(new_m)
        a, b = torch.exp(ref_old - ref_new), torch.exp(ref_m - ref_new)
        old_s = self.s[rows]
        if self.opts.with_entropy:  # 0 · (−inf) at −inf logits is 0
            t = torch.where(e > 0, e * d, 0.0).sum(-1)
            self.t[rows] = a * (self.t[rows] + old_s * (ref_old - ref_new)) + b * (t + s * (ref_m - ref_new))
        if "log_sum_sq_probs" in self.opts.stats:
            self.sq[rows] = a * a * self.sq[rows] + b * b * e.square_().sum(-1)
        self.s[rows] = a * old_s + b * s
        self.m[rows] = new_m

    def finish(self, vocab: int) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
        """(logp, lse, entropy or None, {stat: [rows]}) of the rows, float32 (float64 input: float64); masked rows 0."""
        if self.mask is None:
            keep = lambda x: x  # noqa: E731
        else:
            keep = lambda x: torch.where(self.mask, x, torch.zeros_like(x))  # noqa: E731
        ref, log_s = _reference(self.m), self.s.log()
        lse = self.lse if self.lse_only else ref + log_s
        entropy = keep(log_s - self.t / self.s) if self.opts.with_entropy else None
        out = {}
        for name in self.opts.stats:
            if name == "log_sum_sq_probs":
                out[name] = keep(self.sq.log() - 2 * log_s)
            elif name == "mean_logits":
                out[name] = keep(self.vsum / vocab)
            else:  # the target is the first argmax: it is a max, and every column before it is smaller
                top1 = (self.upto >= self.m) & (self.before < self.upto)
                out[name] = top1 if self.mask is None else top1 & self.mask
        logp = (self.z_t - ref) - log_s if not self.lse_only else self.z_t - lse
        return keep(logp), keep(lse), entropy, out


def row_scale(x: Tensor, mask: Tensor | None, grad_entropy: Tensor | None, opts) -> bool:
    """Whether `tile_grad_` leaves a per-row factor to the GEMMs: float32/float64 tiles, no soft-capping, no entropy
    gradient and every row kept. Then it writes |g|·(q − onehot) and returns σ = −sign(g)·dz/dx per row, and the
    caller applies σ to the rows of dH and of the hidden rows of dW ([rows, H] work instead of a pass over the tile)."""
    plain = opts.final_logit_softcapping is None and grad_entropy is None and mask is None
    return plain and x.dtype == compute_dtype(x.dtype)


def tile_grad_(x: Tensor, v0: Tensor | int, targets: Tensor, mask: Tensor | None, grads: RowGrads,
               opts) -> Tensor | None:  # fmt: skip
    """Overwrite the tile x [rows, w] of logits (columns v0 .. v0 + w) with dL/dx: per row
    (g·(onehot − q) − g_H·q·(log q + H))·dz/dx, q = softmax of the whole row (its lse), z the transformed logits;
    rows that `mask` drops (None: none) get 0. `grads` [rows] each, grad_logp given (zeros when absent). Returns
    None, or, where `row_scale` says, the per-row factor σ [rows] that dL/dx still needs."""
    lse, entropy, grad_logp, grad_entropy = grads.lse, grads.entropy, grads.grad_logp, grads.grad_entropy
    dtype = compute_dtype(x.dtype)
    in_place = x.dtype == dtype
    softcap, scale, temperature = opts.final_logit_softcapping, opts.logit_scale, opts.temperature
    slope = scale / temperature
    step = max(1, WINDOW_ELEMENTS // max(1, x.shape[1]))
    col = lambda v: v.to(dtype)[:, None]  # noqa: E731
    rel = targets - v0
    factor = None
    if row_scale(x, mask, grad_entropy, opts):  # |g|·q = exp(log q + log |g|): no pass for the product
        g_all = grad_logp.to(dtype)
        factor = -torch.sign(g_all) * slope  # [rows]
        lse = lse.to(dtype) - g_all.abs().log()  # [rows]
    for start in range(0, x.shape[0], step):
        rows = slice(start, min(start + step, x.shape[0]))
        log_q = x[rows] if in_place else x[rows].to(dtype)  # [n, w], overwritten by the gradient
        dzdx = None
        if softcap is not None:  # y = s·x/c: z = c/T·tanh y, dz/dx = s/T·sech² y
            y = log_q * (scale / softcap)
            torch.tanh(y, out=log_q).mul_(softcap / temperature)
            dzdx = y.cosh_().square_().reciprocal_().mul_(slope)
        elif slope != 1.0:
            transform_(log_q, temperature, scale, None)
        log_q.sub_(col(lse[rows]))
        g = col(grad_logp[rows])
        r = rel[rows]
        inside = ((r >= 0) & (r < x.shape[1]))[:, None]
        at = r.clamp(0, x.shape[1] - 1)[:, None]
        if factor is not None:  # |g|·(q − onehot)
            log_q.exp_().scatter_add_(1, at, torch.where(inside, -g.abs(), 0.0))
            continue
        if grad_entropy is None:
            grad = log_q.exp_().mul_(-g)
        else:
            q = torch.exp(log_q)
            log_q.add_(col(entropy[rows])).mul_(q).masked_fill_(q == 0, 0.0)  # q·(log q + H)
            grad = log_q.mul_(-col(grad_entropy[rows])).sub_(q.mul_(g))
        grad.scatter_add_(1, at, torch.where(inside, g, 0.0))
        if dzdx is not None:
            grad.mul_(dzdx)
        elif slope != 1.0:
            grad.mul_(slope)
        if mask is not None:
            grad.masked_fill_(~mask[rows, None], 0.0)
        if not in_place:
            x[rows].copy_(grad)
    return factor

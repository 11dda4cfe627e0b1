"""The two-head divergence fused with both lm_heads: student rows hidden_s `[M, H_s]` with weight_s `[V, H_s]`, teacher
rows hidden_t `[M, H_t]` with weight_t `[V, H_t]`; neither `[M, V]` logits tensor exists beyond one chunk of rows.

Per chunk: the two logits GEMMs (into two `[rows, V]` buffers reused by every chunk), the backend's chunk pass on them
(`kernels/torch/divergence.py`, `kernels/triton/divergence.py`), and, in the forward, the student's two gradient GEMMs
(dH for the chunk, dW and db accumulated): the divergence is the last op of the loss, so its dL/dlogits is known as
soon as a chunk's logits are, and the backward only scales the gradients (4 GEMMs in all; TRL's Function recomputes
both heads in its backward: 6). The teacher gets no gradient. GEMMs run in the compute dtype (float32 for
bf16/fp16/fp32, float64 for float64): a half-precision head is upcast once per pass, as TRL projects in float32.

Rows may carry weights (`row_weights`: each row's divergence and gradient scaled), and a `ChunkTerm` may share the
pass: a token-level loss on the student's own log-probs (the GRPO loss of a step with a teacher term,
`teacher_term.py`), its dL/dlogits added to the divergence's before the gradient GEMMs. Where its head transform and
temperature are the divergence's student's and there is no top_k (`shared_sweeps_refusal`), it reads its logp and
entropy from the divergence's sweeps and its gradient joins the divergence's in the last sweep (the backend's chunk
pass takes it as `token_loss`): one student vocabulary pass per chunk. Elsewhere it runs its own vocabulary pass on
the student's raw chunk logits before the divergence overwrites them, into a third `[rows, V]` buffer.

`memory="lean"` runs `divergence_lean.py` instead (tiles of rows × vocabulary columns, the gradients in the backward).
`SUPPORT` is the capability record of this pass, one entry per backend: what runs it, or why it is refused.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.divergence_lean import LeanDivergenceFunction
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.protocol import compute_dtype
from grpo_kernels.kernels.torch.divergence import ChunkSpec, Head, TokenGradient


@dataclass(frozen=True)
class DivergenceSupport:
    """A backend's record for the two-head divergence: whether it runs it and why not, the module of its chunk pass
    (`divergence_chunk`, imported on first use; the top-k-plus-tail variant's `topk_divergence_chunk` from the
    module's `_topk` sibling), and why it refuses float64 heads or memory="lean" ("" where it runs them)."""

    backend: str
    runs: bool
    why_not: str = ""
    module: str = ""
    float64_why_not: str = ""
    lean_why_not: str = ""

    def refusal(self, top_k: int, dtype: torch.dtype, memory: str = "fast") -> str:
        """Why this backend refuses a call with `top_k` on heads of `dtype` in `memory` mode, or "" when it runs it."""
        if not self.runs:
            return self.why_not
        if memory == "lean" and (self.lean_why_not or top_k):
            return self.lean_why_not or LEAN_TOP_K
        return self.float64_why_not if dtype == torch.float64 else ""


SUPPORT = {
    "torch": DivergenceSupport("torch", True, module="grpo_kernels.kernels.torch.divergence"),
    "triton": DivergenceSupport(
        "triton",
        True,
        module="grpo_kernels.kernels.triton.divergence",
        float64_why_not="float64 heads: the Triton divergence computes in float32; use backend='torch'",
        lean_why_not="memory='lean' (vocabulary tiles) runs on backend='torch' only: the Triton kernel works on whole "
        "rows of a chunk",
    ),  # fmt: skip
    "cuda": DivergenceSupport(
        "cuda", False, "the two-head divergence has no CUDA extension kernels: use backend='torch' or 'triton'"
    ),  # fmt: skip
}
# Vocabulary columns per elementwise block of the torch chunk pass: on the CPU a block of a chunk's few hundred rows
# stays in its last-level cache (docs/benchmarks.md, the teacher term); elsewhere wide blocks, fewer launches.
BLOCK_COLUMNS = {"cpu": 4096, "other": 32768}
MEMORY_MODES = ("fast", "lean")  # row chunks with two [rows, V] buffers; tiles (`divergence_lean.py`)
LEAN_TOP_K = "top_k > 0 with memory='lean': the top-k-plus-tail divergence needs whole rows; use memory='fast'"


@dataclass(frozen=True)
class DivergenceOptions:
    """How one two-head pass runs: `beta` (0 forward KL, 1 reverse KL, else generalized JSD), the temperature shared by
    both heads, each head's transform, rows per chunk, vocabulary columns per elementwise block (None: by device,
    `BLOCK_COLUMNS`), and the top-k variant's k (0: the whole vocabulary)."""

    beta: float
    temperature: float = 1.0
    student: Head = Head()
    teacher: Head = Head()
    chunk_size: int = 128
    block: int | None = None
    top_k: int = 0
    backend: str = "torch"
    memory: str = "fast"  # "fast": row chunks (this module); "lean": tiles (`divergence_lean.py`)
    tile: tuple[int | None, int | None] = (None, None)  # lean: (rows, columns) per tile; None: from its budget

    def chunk_spec(self, with_grad: bool, device: torch.device) -> ChunkSpec:
        """The record a backend's chunk pass reads (`divergence_chunk`) for tensors on `device`."""
        block = self.block or BLOCK_COLUMNS.get(device.type, BLOCK_COLUMNS["other"])
        return ChunkSpec(self.beta, self.temperature, self.student, self.teacher, with_grad, block)


@functools.cache
def chunk_pass(backend: str, top_k: bool = False) -> Callable:
    """The `divergence_chunk` of `backend`'s record (with `top_k`: `topk_divergence_chunk`, from its module's
    `_topk` sibling), its module imported on first use (after the backend's own import check: a clear error for an
    unsupported triton)."""
    before = backends.CAPABILITIES[backend].before_import
    if before is not None:
        before()
    if top_k:
        return importlib.import_module(SUPPORT[backend].module + "_topk").topk_divergence_chunk
    return importlib.import_module(SUPPORT[backend].module).divergence_chunk


def _operands(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _project(hidden: Tensor, weight: Tensor, bias: Tensor | None, *, out: Tensor) -> Tensor:
    """out `[c, V]` = hidden @ weight.T (+ bias), in out's dtype."""
    hidden = hidden.to(out.dtype)
    if bias is None:
        return torch.mm(hidden, weight.T, out=out)
    return torch.addmm(bias, hidden, weight.T, out=out)


class _StudentGradients:
    """dH rows, dW and db of the student's head, accumulated in the compute dtype from each chunk's dL/dlogits."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, bool, bool], dtype):
        self.hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if needs[0] else None
        self.weight = torch.empty(weight.shape, dtype=dtype, device=weight.device) if needs[1] else None
        self.weight_written = False  # the first chunk's product is written, not added to zeros (one [V, H] pass less)
        self.bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs[2] else None

    def add(self, rows: slice, grad_logits: Tensor, hidden: Tensor, weight: Tensor) -> None:
        if self.hidden is not None:
            torch.mm(grad_logits, weight, out=self.hidden[rows])
        if self.weight is not None:
            hidden = hidden.to(grad_logits.dtype)
            if self.weight_written:
                self.weight.addmm_(grad_logits.T, hidden)
            else:
                torch.mm(grad_logits.T, hidden, out=self.weight)
                self.weight_written = True
        if self.bias is not None:
            self.bias += grad_logits.sum(0)

    def result(self, scale: Tensor, like: tuple[Tensor, Tensor, Tensor | None]) -> list[Tensor | None]:
        """The gradients times `scale`, in their inputs' dtypes; the accumulators are released."""
        if self.weight is not None and not self.weight_written:  # no rows: a zero gradient
            self.weight.zero_()
        grads = [self.hidden, self.weight, self.bias]
        self.hidden = self.weight = self.bias = None
        return [None if g is None else g.mul_(scale.to(g.dtype)).to(x.dtype) for g, x in zip(grads, like, strict=True)]


class ChunkTerm(Protocol):
    """A token-level loss on the student's rows sharing the pass (the GRPO loss of a step with a teacher term): its
    sampled tokens `targets` `[M]` and its vocabulary pass's `opts` (backend, head transform, temperature, whether it
    reads the entropy). Called once per chunk with the rows' logp and entropy `[c]` (None unless `opts.with_entropy`)
    under its own transform, it adds the chunk's share to `loss()` and returns (dL/dlogp, dL/dentropy or None) `[c]`;
    `own_pass(rows, logits, grad_out)` runs its own vocabulary pass on a chunk's raw logits `[c, V]` (read only)
    instead, calling it and writing dL/dlogits into `grad_out` (None: no gradient taken)."""

    targets: Tensor
    opts: PassOptions

    def __call__(self, rows: slice, logp: Tensor, entropy: Tensor | None) -> tuple[Tensor | None, Tensor | None]: ...

    def own_pass(self, rows: slice, logits: Tensor, grad_out: Tensor | None) -> None: ...

    def loss(self) -> Tensor: ...


def shared_sweeps_refusal(term: PassOptions, opts: DivergenceOptions) -> str:
    """Why a `ChunkTerm` with vocabulary pass `term` runs its own pass on each chunk instead of sharing the
    divergence's sweeps ("" where it shares them)."""
    if opts.top_k:
        return "top_k > 0: the top-k-plus-tail divergence's chunk pass takes no token loss"
    head = Head(term.logit_scale, term.final_logit_softcapping)
    if (term.temperature, head) != (opts.temperature, opts.student):
        return (f"the loss's temperature {term.temperature} and head {head} are not the divergence's student's "
                f"({opts.temperature}, {opts.student}): its log-probs come from its own pass")  # fmt: skip
    return ""


class _FusedLinearDivergenceFunction(torch.autograd.Function):
    """(hidden_s, weight_s, bias_s, hidden_t, weight_t, bias_t, targets [M] | None, topk_ids [M, k] | None) ->
    Σ_rows w·divergence (+ a `ChunkTerm`'s shares; w: `row_weights` [M], None: 1), differentiable in the student's
    three tensors, and, detached, the per-row divergence, entropy, logp (empty without targets), student and teacher
    lse `[M]`, and the top-k ids `[M, k]` (empty without top_k)."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, targets, topk_ids, opts, grad_enabled,
                row_weights=None, term=None):  # fmt: skip
        dtype = compute_dtype(s_weight.dtype)
        needs = tuple(grad_enabled and need for need in ctx.needs_input_grad[:3])  # none under torch.no_grad()
        with_grad = any(needs)
        grads = _StudentGradients(s_hidden, s_weight, s_bias, needs, dtype) if with_grad else None
        ws, bs = _operands(s_weight, s_bias, dtype)
        wt, bt = _operands(t_weight, t_bias, dtype)
        M, V = s_hidden.shape[0], s_weight.shape[0]
        rows = max(1, min(opts.chunk_size, M))
        s_buf, t_buf = ws.new_empty(rows, V), ws.new_empty(rows, V)  # [rows, V] each, reused by every chunk
        shared = term is not None and not shared_sweeps_refusal(term.opts, opts)
        if shared:
            targets = term.targets  # the divergence's logp is the term's
        own_pass = term is not None and not shared
        term_buf = ws.new_empty(rows, V) if own_pass and with_grad else None  # the own pass's dL/dlogits
        outs = {name: [] for name in ("divergence", "entropy", "logp", "lse_s", "lse_t", "ids")}
        spec = opts.chunk_spec(with_grad, s_hidden.device)
        for start in range(0, M, rows):
            r = slice(start, min(start + rows, M))
            backends.count_launch(opts.backend)
            zs = _project(s_hidden[r], ws, bs, out=s_buf[: r.stop - start])
            zt = _project(t_hidden[r], wt, bt, out=t_buf[: r.stop - start])
            if own_pass:  # before the divergence overwrites the student's logits
                term.own_pass(r, zs, None if term_buf is None else term_buf[: r.stop - start])
            chunk_targets = None if targets is None else targets[r]
            if opts.top_k:
                ids = None if topk_ids is None else topk_ids[r]
                *values, ids = chunk_pass(opts.backend, True)(zs, zt, chunk_targets, spec, k=opts.top_k, ids=ids)
                outs["ids"].append(ids)
            elif shared:
                token_loss = functools.partial(_token_gradient, term, r, row_weights)
                values = chunk_pass(opts.backend)(zs, zt, chunk_targets, spec, token_loss=token_loss)
            else:
                values = chunk_pass(opts.backend)(zs, zt, chunk_targets, spec)
            for name, value in zip(("divergence", "entropy", "logp", "lse_s", "lse_t"), values, strict=True):
                if value is not None:
                    outs[name].append(value)
            if grads is not None:
                grad = zs if row_weights is None or shared else zs.mul_(row_weights[r, None])  # shared: weighted
                grads.add(r, term_buf[: r.stop - start].add_(grad) if own_pass else grad, s_hidden[r], ws)
        joined = {name: _cat(parts, s_hidden, dtype) for name, parts in outs.items() if name != "ids"}
        ids = torch.cat(outs["ids"]) if outs["ids"] else s_hidden.new_empty((0,), dtype=torch.long)
        divergence = joined["divergence"] if row_weights is None else joined["divergence"] * row_weights
        total = divergence.sum() if term is None else divergence.sum() + term.loss()
        ctx.grads, ctx.like = grads, (s_hidden, s_weight, s_bias)
        details = (*(joined[name] for name in ("divergence", "entropy", "logp", "lse_s", "lse_t")), ids)
        ctx.mark_non_differentiable(*details)
        return total, *details

    @staticmethod
    def backward(ctx, grad_total, *_details):
        grads, ctx.grads = ctx.grads, None
        if grads is None or grad_total is None:
            return (None,) * 12
        return (*grads.result(grad_total, ctx.like), *(None,) * 9)


def _token_gradient(term: ChunkTerm, rows: slice, row_weights: Tensor | None, logp: Tensor, entropy: Tensor):
    """The `TokenGradient` of a shared `term` on a chunk's rows from the divergence's logp and entropy `[c]`."""
    grad_logp, grad_entropy = term(rows, logp, entropy if term.opts.with_entropy else None)
    weight = None if row_weights is None else row_weights[rows]
    return TokenGradient(term.targets[rows], grad_logp, grad_entropy, weight)


def _cat(parts: list[Tensor], like: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.cat(parts) if parts else like.new_empty((0,), dtype=dtype)


def fused_linear_divergence_rows(
    student: tuple[Tensor, Tensor, Tensor | None],
    teacher: tuple[Tensor, Tensor, Tensor | None],
    targets: Tensor | None,
    topk_ids: Tensor | None,
    opts: DivergenceOptions,
    row_weights: Tensor | None = None,
    term: ChunkTerm | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(Σ divergence over the rows, each times its `row_weights` (`[M]` in the compute dtype; None: 1), plus the
    loss of `term` (a token-level loss on the student's rows, `ChunkTerm`), differentiable in the student's hidden,
    weight and bias; {"divergence", "entropy", "logp" (with targets), "lse_s", "lse_t", "topk_ids" (with top_k)},
    `[M]` each, unweighted and detached) for rows already chosen (every row is kept)."""
    grad_enabled = torch.is_grad_enabled()
    function = LeanDivergenceFunction if opts.memory == "lean" else _FusedLinearDivergenceFunction
    extra = () if opts.memory == "lean" else (row_weights, term)
    if opts.memory == "lean" and (row_weights is not None or term is not None):
        raise ValueError("row weights and a shared chunk term run on the row-chunked pass (memory='fast') only")
    if term is not None and targets is not None:
        raise ValueError("targets with a shared chunk term: the term's own targets give the pass's logp")
    total, *details = function.apply(*student, *teacher, targets, topk_ids, opts, grad_enabled, *extra)
    names = ("divergence", "entropy", "logp", "lse_s", "lse_t", "topk_ids")
    out = dict(zip(names, details, strict=True))
    if targets is None:
        del out["logp"]
    if not opts.top_k:
        del out["topk_ids"]
    return total, out

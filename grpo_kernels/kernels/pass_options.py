"""PassOptions: how one vocabulary pass runs, as plain data the engine hands to the kernels.

The kernels read it and import nothing of the engine or the losses: the row check arrives as a callable, a fused
loss epilogue as a record of flags and constants (`losses/epilogue.py` declares it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

RowCheck = Callable[[Tensor, Tensor, Tensor | None], None]  # (lse, logp, kept rows or None) -> raises on a bad row


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


@dataclass(frozen=True)
class PassOptions:
    """A concrete backend; the logit transform z = c·tanh(s·x/c) / temperature (TRL's order); whether to compute
    the entropy and which extra statistics; the check of each kept row's lse / logp (None: unchecked, a bad row's
    logp becomes NaN). Logits in: whether the backward writes into the logits' buffer. Fused lm_head: rows per
    chunk ("fast") or the chunks' row offsets, the memory mode, the lean tile and the logits GEMM's precision.
    `replay`: the truncated sampler's support to renormalise over."""

    backend: str
    temperature: float = 1.0
    with_entropy: bool = False
    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None
    stats: tuple[str, ...] = ()
    row_check: RowCheck | None = None
    inplace: bool = True
    chunk_size: int | None = None  # rows per chunk; None: from V, H and free memory
    chunk_bounds: tuple[int, ...] | None = None  # the chunks' row offsets (0, .., M), each chunk <= chunk_size
    # rows (`engine/plan.sequence_chunks`: whole sequences); None: chunk_size rows each
    memory: str = "fast"  # "fast": row chunks, 3 or 4 GEMMs; "lean": 2-D tiles at the memory floor (fused_linear_lean)
    tile: tuple[int, int] | None = None  # lean: (rows, vocab) per tile; None: from the budget and the dtypes
    head_precision: str = "auto"  # the fused lm_head's logits GEMM precision (kernels/head_precision.py)
    replay: Replay | None = None  # the sampler's support the pass renormalises over (kernels/replay.py); None: V

    def __post_init__(self) -> None:
        """Formed once (not fields): `transform`, the keyword arguments of the logit transform, and `pass_fields`,
        those of a backend's pass record (`protocol.VocabPassArgs`) besides its tensors."""
        transform = {"logit_scale": self.logit_scale, "softcap": self.final_logit_softcapping}
        object.__setattr__(self, "transform", transform)
        fields = dict(temperature=self.temperature, with_entropy=self.with_entropy, stats=self.stats, **transform)
        object.__setattr__(self, "pass_fields", fields)

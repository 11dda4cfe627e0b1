"""A token-level loss formed chunk by chunk in a fused lm_head's forward: the step each chunk of rows takes once its
log-probs (and entropy) are known, shared by the fused lm_head (`fused_linear.py`) and the two-head pass of a GRPO
step with a teacher term (`teacher_term.py`).

Per chunk the loss's `chunk_loss(rows, logp, entropy)` gives the chunk's share, dL/dlogp and dL/dentropy; the share
joins the running loss and the gradients go back to the caller, who writes dL/dlogits from them. Non-finite
gradients must not hide in a finite loss: where the pass checked its rows, the sum of the gradients is kept (finite
iff they are); where it did not, a flag of any kept row with a non-finite lse, logp or gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_kernels.kernels.logits_driver import nonfinite_rows, not_finite_to_nan, poisoned

ChunkLoss = Callable[[slice, Tensor, Tensor | None], tuple[Tensor, Tensor | None, Tensor | None]]


class TokenLossStep:
    """`chunk_loss` over a pass's chunks: each call adds a chunk's share to the loss and returns its (dL/dlogp,
    dL/dentropy or None) `[c]`; `loss()` is the sum, NaN where a kept row's gradient was not finite. `checked`: the
    pass checks its rows' lse and logp itself (then only the gradients are watched)."""

    def __init__(self, chunk_loss: ChunkLoss, checked: bool, dtype: torch.dtype, device: torch.device):
        self.chunk_loss, self.checked = chunk_loss, checked
        self.total = torch.zeros((), dtype=dtype, device=device)  # float64 stays so
        self.gradient_sum = torch.zeros_like(self.total)  # checked: Σ dL/dlogp + Σ dL/dentropy
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # unchecked: a flagged kept row

    def __call__(
        self, rows: slice, logp: Tensor, entropy: Tensor | None, lse: Tensor | None = None, kept: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The chunk's (dL/dlogp, dL/dentropy), `[c]` each, from its rows' logp and entropy (None when the loss reads
        none); unchecked, `lse` and the `kept` rows `[c]` (None: all) flag a non-finite row."""
        share, grad_logp, grad_entropy = self.chunk_loss(rows, logp, entropy)
        self.total += share
        if self.checked:
            for grad in (g for g in (grad_logp, grad_entropy) if g is not None):
                self.gradient_sum += grad.sum()
        else:
            flagged = nonfinite_rows(lse, logp, grad_logp, grad_entropy)
            self.bad |= (flagged if kept is None else flagged & kept).any()
        return grad_logp, grad_entropy

    def loss(self) -> Tensor:
        """The chunks' summed shares (0-d), NaN where a kept row's gradient was not finite; no host sync."""
        return not_finite_to_nan(self.total, self.gradient_sum) if self.checked else poisoned(self.total, self.bad)

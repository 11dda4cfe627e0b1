"""The lm_head under DeepSpeed ZeRO-3: whole for each fused pass, with the same collectives on every rank.

ZeRO-3 keeps each parameter partitioned (an empty `.data`) outside the forward of the module that owns it, and the
fused head reads `lm_head.weight` without calling that module. Inside a DeepSpeed engine's forward, DeepSpeed
gathers a parameter read there and registers it with the running module, which gathers it again for its backward;
a forward called on the bare model (as TRL calls its policy for the old log-probs) has no such discovery.
`gathered(weight, bias)` covers both: it gathers what is not gathered yet for the pass, and, where the pass saved a
parameter for its backward (the 4-GEMM and lean routes; the 3-GEMM token-level route forms every gradient in the
forward and saves none), gathers it once more in that backward unless the module's hooks did. Gathering never
depends on the number of rows, so every rank makes the same collectives. dW reaches ZeRO-3's partitioned gradient
through autograd: the fused Function's weight input is the parameter itself.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def _partitioned(params: list[Tensor]) -> list[Tensor]:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]


def _gather(params: list[Tensor]):
    """A context in which the ZeRO-3 `params` are whole: one gather of those not gathered now (else nothing)."""
    import deepspeed

    todo = _partitioned(params)
    return deepspeed.zero.GatheredParameters(todo) if todo else contextlib.nullcontext()


class _Regather:
    """Saved-tensor hooks for ZeRO-3 parameters: one saved for backward is packed as its index; unpacked, it is
    the parameter itself when its module's hooks hold it gathered, else a copy from one gather of them all."""

    def __init__(self, params: list[Tensor]):
        self.params = params
        self.copies: dict[int, Tensor] = {}

    def pack(self, x: Tensor) -> Tensor | int:
        return next((i for i, p in enumerate(self.params) if x is p), x)

    def unpack(self, packed: Tensor | int) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        if not _partitioned([self.params[packed]]):
            return self.params[packed]
        if packed not in self.copies:
            with _gather(self.params):
                self.copies = {i: p.data.clone() for i, p in enumerate(self.params)}
        return self.copies.pop(packed)


@contextlib.contextmanager
def gathered(*params: Tensor | None):
    """Inside: `params` (lm_head.weight and bias) whole, gathered by one call where ZeRO-3 holds them partitioned;
    what the block saves of them for backward is gathered again there (once) if partitioned then. Parameters that
    are not ZeRO-3's (no `ds_id`): nothing."""
    zero = list({id(p): p for p in params if p is not None and hasattr(p, "ds_id")}.values())
    if not zero:
        yield
        return
    regather = _Regather(zero)
    with _gather(zero), torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack):
        yield

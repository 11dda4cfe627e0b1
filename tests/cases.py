"""Named hard cases every op test runs: shapes and values where vocabulary passes usually go wrong."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    B: int = 3
    T: int = 5
    V: int = 37  # prime: never a multiple of a block
    temperature: float = 1.0
    scale: float = 2.0  # logits ~ N(0, scale²)


CASES = (
    Case("ragged_vocab"),
    Case("multi_block_vocab", B=2, T=3, V=5003),  # prime, larger than the kernels' 4096-wide block
    Case("masked_row"),
    Case("neg_inf_logits"),
    Case("extreme_logits", scale=1e4),
    Case("non_contiguous"),
    Case("edge_ids"),
    Case("temperature", temperature=0.7),
    Case("single_token", T=1),
)
CASE_IDS = [c.name for c in CASES]


def make_inputs(case: Case, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """logits [B, T, V] (dtype), targets [B, T], mask [B, T] bool, with the case's twist applied.

    Every case masks one sequence fully and a few more tokens; masked rows of logits hold NaN, so a kernel
    that reads them poisons its output.
    """
    g = torch.Generator().manual_seed(seed)
    B, T, V = case.B, case.T, case.V
    logits = torch.randn(B, T, V, generator=g) * case.scale
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0, 0] = True
    mask[-1] = False  # a fully masked sequence
    if case.name == "neg_inf_logits":
        ninf = torch.rand(B, T, V, generator=g) < 0.3
        ninf.scatter_(-1, targets[..., None], False)  # the target itself stays finite
        logits[ninf] = float("-inf")
        logits[0, 0, : V // 2] = float("-inf")  # a whole first block of -inf
        logits[0, 0, targets[0, 0]] = 0.0
    if case.name == "edge_ids":
        targets[:, ::2] = 0
        targets[:, 1::2] = V - 1
    logits[~mask] = float("nan")
    logits = logits.to(dtype)
    if case.name == "non_contiguous":  # a strided view in B and T, like logits[:, :-1] of a causal LM
        wide = torch.full((B, T + 1, V + 3), float("nan"), dtype=dtype)
        wide[:, :T, :V] = logits
        logits = wide[:, :T, :V]
        assert not logits.is_contiguous()
    return {"logits": logits.to(device), "targets": targets.to(device), "mask": mask.to(device)}

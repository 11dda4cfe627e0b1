"""The Triton backend's launches as torch.library custom ops (`kernels/triton/ops.py`): every op passes
`torch.library.opcheck` on CPU tensors under the interpreter (its schema and declared mutations, its fake against the
real op, the op through AOT dispatch with dynamic shapes), and the one check opcheck cannot run (a split pass leaves
partial statistics unwritten) is made on the fake directly under FakeTensorMode. The protocol functions over the ops
give what the launchers give."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs

pytest.importorskip("triton")

from grpo_kernels.kernels.triton import ops  # noqa: E402
from grpo_kernels.kernels.triton import token_logprobs as launch  # noqa: E402

B, T, V = 2, 3, 40
STATS = (True, True, True)  # log Σ q², the mean logit, top-1: every optional output


def _inputs(all_kept: bool = False) -> dict:
    torch.manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.bool)
    if not all_kept:
        mask[1, 2] = False
    return dict(
        logits=torch.randn(B, T, V) * 3,
        targets=torch.randint(0, V, (B, T)),
        mask=mask,
        row=torch.randn(B, T),
        per_sequence=torch.randn(B, 1).expand(B, T),  # stride 0 in T, as the drivers pass advantages
    )


def _partials_args(all_kept: bool = True) -> tuple:
    x = _inputs(all_kept)
    return x["logits"], x["targets"].to(torch.int32), x["mask"], 0.7, True, 1.0, 30.0, *STATS


def _cases() -> dict[str, tuple]:
    """Op name -> arguments: each op once, with its optional outputs and inputs given."""
    x = _inputs()
    partial = ops._token_logprobs_partials(*_partials_args())
    loss_constants = ("clip", 0.2, 0.28, 1.5, 3.0, False, 0.04, "k3", True, 1.0, 1.05, 0.9, True, 1.0, None)
    bwd = (x["targets"], x["mask"], x["row"], x["row"].abs(), x["row"], x["row"], 0.7, 1.0, 30.0)
    return {
        "token_logprobs_fwd": (x["logits"], x["targets"], x["mask"], 0.7, True, 1.0, 30.0, *STATS),
        "token_logprobs_bwd": (x["logits"], *bwd, torch.empty_like(x["logits"])),
        "token_logprobs_bwd_inplace": (x["logits"].clone(), *bwd),
        "grpo_loss_fwd": (
            x["logits"],
            x["targets"],
            x["mask"],
            x["row"].abs(),
            x["per_sequence"],
            -x["row"].abs(),
            -x["row"].abs() - 0.1,
            x["per_sequence"].abs(),
            *loss_constants,
        ),
        "token_logprobs_partials": _partials_args(),
        "token_logprobs_merge": (partial, torch.ones(B * T, dtype=torch.bool), V, 0.7, True, 1.0, 30.0, *STATS),
    }


def test_every_op_is_checked():
    assert set(ops.OPS) == set(_cases())
    assert {op._schema.name for op in ops.OPS.values()} == {f"grpo_kernels_triton::{name}" for name in _cases()}


@pytest.mark.parametrize("name", sorted(_cases()))
def test_opcheck(name):
    torch.library.opcheck(ops.OPS[name], _cases()[name])


def test_declared_mutations():
    """The two backward ops declare the buffer they write, and no other op declares a write."""
    written = {
        name: [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        for name, op in ops.OPS.items()
    }
    assert written == {name: [] for name in ops.OPS} | dict(
        token_logprobs_bwd=["out"], token_logprobs_bwd_inplace=["logits"]
    )


def test_split_partials_fake_matches_the_real_op(monkeypatch):
    """With V cut into V-blocks (MIN_SPLIT_COLUMNS lowered), the fake's block count is the real launch's."""
    monkeypatch.setattr(launch, "MIN_SPLIT_COLUMNS", 8)
    args = _partials_args(all_kept=False)
    real = ops._token_logprobs_partials(*args)
    assert real.shape[2] > 1
    with FakeTensorMode() as mode:
        fake = ops._token_logprobs_partials(*(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args))
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)


def test_protocol_functions_match_the_launchers():
    """The functions the drivers call return the launchers' values, None where nothing was asked."""
    x = _inputs()
    stats = ("mean_logits", "is_top1")
    args = VocabPassArgs(logits=x["logits"], targets=x["targets"], mask=x["mask"], temperature=0.7, softcap=30.0)
    want = launch.token_logprobs_fwd(dataclasses.replace(args, stats=stats))
    got = ops.token_logprobs_fwd(dataclasses.replace(args, stats=stats))
    assert got[2] is None and want[2] is None and set(got[3]) == set(stats)
    for a, b in zip((*got[:2], *got[3].values()), (*want[:2], *want[3].values()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grad = torch.randn(B, T)
    want_grad = torch.empty_like(x["logits"])
    grads = RowGrads(lse=got[1], grad_logp=grad)
    launch.token_logprobs_bwd(args, grads, want_grad)
    out = torch.empty_like(x["logits"])
    ops.token_logprobs_bwd(args, grads, out)
    in_place = x["logits"].clone()
    ops.token_logprobs_bwd(dataclasses.replace(args, logits=in_place), grads, in_place)
    torch.testing.assert_close(out, want_grad, rtol=0, atol=0)
    torch.testing.assert_close(in_place, want_grad, rtol=0, atol=0)

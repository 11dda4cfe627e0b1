"""Host syncs of the functional API's forward + backward, counted on CPU; the CUDA graph capture where a GPU is.

What the CPU count proves: `HostReads` logs every host read of tensor values that the call makes outside Triton's
interpreter (`.item()`, `bool()`, `int()`, `float()`, `.tolist()`, `.numpy()`, `.cpu()`) and every op whose size
or result is decided by values on the host (`nonzero`, boolean indexing and index_put, `masked_select`, `unique`,
`repeat_interleave` without `output_size`): on CUDA each of them waits for the device. With the Triton backend the
Python path is the CUDA one, so the counts below are its syncs: with the checks on, one before the first kernel
(mask values, target range, non-finite inputs and, for the fused lm_head, the kept-row count) and one after the
forward pass (the rows' log-sum-exp); with `check_finite=False`, none for the logits-level calls and one (the
kept-row count) for the fused lm_head, none when it runs every row (as inside a CUDA graph capture). It cannot
see a sync inside a kernel or a C++ op that reads memory directly; the `cuda` tests check those on a GPU.
"""

from __future__ import annotations

import math
import os
import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk
from grpo_kernels.engine import layout
from tests.conftest import DEVICE

aten = torch.ops.aten
B, T, H, V = 2, 4, 16, 64
SIZED_BY_VALUES = {aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim, aten.unique_consecutive}
SIZED_BY_VALUES |= {aten.is_nonzero, aten._local_scalar_dense, aten.equal}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
HOST_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


def _in_triton() -> bool:
    """Whether the call comes from Triton's own package (its CPU interpreter copies arguments to the host)."""
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _where() -> str:
    """The innermost grpo_kernels line on the stack."""
    for entry in reversed(traceback.extract_stack()):
        if f"{os.sep}grpo_kernels{os.sep}" in entry.filename:
            return f"{entry.filename.split(os.sep + 'grpo_kernels' + os.sep)[-1]}:{entry.lineno}"
    return "?"


class _Ops(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        sized = packet in SIZED_BY_VALUES
        sized |= packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) < 3
        if packet in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            sized |= any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
        if sized and not _in_triton():
            self.log.append((str(func), _where()))
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_METHODS and not _in_triton():
            self.log.append((func.__name__, _where()))
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context: `reads` lists (op, where) of each host read of tensor values made inside it."""

    def __enter__(self):
        self.reads: list[tuple[str, str]] = []
        self._modes = [_Methods(self.reads), _Ops(self.reads)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    inputs = {
        "hidden": torch.randn(B, T, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / H**0.5,
        "targets": torch.randint(0, V, (B, T), generator=g),
        "advantages": torch.randn(B, generator=g),
        "old_logp": -3.0 - torch.rand(B, T, generator=g),
        "mask": mask,
    }
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def _step(kind: str, check_finite: bool, inputs: dict, **options):
    """Forward and backward of one functional call; returns (loss or logp, grads)."""
    hidden = inputs["hidden"].clone().requires_grad_()
    weight = inputs["weight"].clone().requires_grad_()
    loss_args = (inputs["targets"], inputs["advantages"], inputs["old_logp"], None, inputs["mask"])
    common = dict(backend="triton", check_finite=check_finite)
    if kind == "grpo_loss":
        logits = (hidden @ weight.T).detach().requires_grad_()
        out = gk.grpo_loss(logits, *loss_args, **common, **options).loss
        out.backward()
        return out, (logits.grad,)
    if kind == "token_logprobs":
        logits = (hidden @ weight.T).detach().requires_grad_()
        out = gk.token_logprobs(logits, inputs["targets"], mask=inputs["mask"], with_entropy=True, **common)
        (out[0].sum() + out[1].sum()).backward()
        return out[0], (logits.grad,)
    if kind == "fused_linear_grpo_loss":
        out = gk.fused_linear_grpo_loss(hidden, weight, *loss_args, chunk_size=3, **common, **options).loss
        out.backward()
        return out, (hidden.grad, weight.grad)
    out = gk.fused_linear_token_logprobs(hidden, weight, inputs["targets"], mask=inputs["mask"], chunk_size=3, **common)
    out.sum().backward()
    return out, (hidden.grad, weight.grad)


# (kind, loss options) -> host reads with the checks on, with them off
CASES = {
    "grpo_loss/dapo_fused_epilogue": ("grpo_loss", dict(loss_type="dapo"), 2, 0),
    "grpo_loss/gspo_two_phase": ("grpo_loss", dict(loss_type="grpo", importance_sampling_level="sequence"), 2, 0),
    "grpo_loss/clip_cov": ("grpo_loss", dict(loss_type="clip_cov", clip_cov_lb=-10.0), 3, 1),  # K sizes its draw
    "token_logprobs": ("token_logprobs", {}, 2, 0),
    "fused_linear_grpo_loss/dapo": ("fused_linear_grpo_loss", dict(loss_type="dapo"), 2, 1),
    "fused_linear_grpo_loss/gspo": (
        "fused_linear_grpo_loss",
        dict(loss_type="grpo", importance_sampling_level="sequence"),
        2,
        1,
    ),
    "fused_linear_token_logprobs": ("fused_linear_token_logprobs", {}, 2, 1),
}


@pytest.mark.parametrize("check_finite", (True, False), ids=("checks_on", "checks_off"))
@pytest.mark.parametrize("case", CASES)
def test_host_reads(case, check_finite):
    """The number of host syncs of one forward + backward: one batched read before the first kernel and one after
    the forward pass with the checks on; with them off none, but the fused lm_head's kept-row count (and
    clip_cov's candidate count, which sizes verl's CPU draw)."""
    kind, options, on, off = CASES[case]
    inputs = _inputs()
    with HostReads() as host:
        _step(kind, check_finite, inputs, **options)
    assert len(host.reads) == (on if check_finite else off), host.reads


@pytest.mark.parametrize("loss_type", ("dapo", "grpo"))
@pytest.mark.parametrize("kind", ("fused_linear_grpo_loss", "fused_linear_token_logprobs"))
def test_fused_lm_head_every_row_is_sync_free(kind, loss_type, monkeypatch):
    """The fused lm_head's sync-free path (every row, masked: what runs inside a CUDA graph capture with the checks
    off) reads nothing on the host and gives the gathered path's loss and gradients."""
    inputs = _inputs(1)
    options = dict(loss_type=loss_type, beta=0.0) if kind == "fused_linear_grpo_loss" else {}
    gathered, gathered_grads = _step(kind, False, inputs, **options)
    monkeypatch.setattr(layout, "all_rows", lambda check_finite, device: not check_finite)
    with HostReads() as host:
        every, every_grads = _step(kind, False, inputs, **options)
    assert host.reads == []
    torch.testing.assert_close(every, gathered, rtol=1e-5, atol=1e-6)
    for a, b in zip(every_grads, gathered_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_value_checks_are_one_read_and_still_raise():
    """The value checks still name the bad input, from the one batched read (and no kernel ran before it)."""
    inputs = _inputs()
    bad_targets = inputs["targets"].clone()
    bad_targets[0, 0] = V
    with pytest.raises(ValueError, match=r"targets must lie in \[0, V\)"):
        gk.grpo_loss(inputs["hidden"] @ inputs["weight"].T, bad_targets, inputs["advantages"], backend="triton")
    old = inputs["old_logp"].clone()
    old[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"old_logp must be finite where the mask keeps a token"):
        gk.grpo_loss(inputs["hidden"] @ inputs["weight"].T, inputs["targets"], inputs["advantages"], old)


@pytest.mark.parametrize(
    "kind", ("grpo_loss", "token_logprobs", "fused_linear_grpo_loss", "fused_linear_token_logprobs")
)
def test_unchecked_bad_target_gives_nan(kind):
    """check_finite=False reads no target on the host: an id outside [0, V) at a kept token is never used as an
    index (no read outside a row) and makes that token's logp, and the loss, NaN."""
    inputs = _inputs()
    inputs["targets"] = inputs["targets"].clone()
    inputs["targets"][0, 0] = V + 7
    out, grads = _step(kind, False, inputs, **({"loss_type": "dapo"} if "loss" in kind else {}))
    if out.dim() == 0:
        assert math.isnan(out.item())
    else:
        assert math.isnan(out[0, 0].item()) and torch.isfinite(out[1:]).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "kind,options",
    [
        ("grpo_loss", dict(loss_type="dapo")),
        ("grpo_loss", dict(loss_type="grpo", importance_sampling_level="sequence")),
        ("token_logprobs", {}),
        ("fused_linear_grpo_loss", dict(loss_type="dapo")),
        ("fused_linear_grpo_loss", dict(loss_type="grpo", importance_sampling_level="sequence")),
        ("fused_linear_token_logprobs", {}),
    ],
)
def test_cuda_graph_capture(kind, options, monkeypatch):
    """With check_finite=False the functional API's forward + backward is captured in one CUDA graph (any host
    sync would abort the capture), and a replay gives the eager result."""
    inputs = _inputs(2)
    eager, eager_grads = _step(kind, False, inputs, **options)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), monkeypatch.context() as patch:  # warm-up: compile what the capture runs
        patch.setattr(layout, "all_rows", lambda check_finite, device: not check_finite)
        for _ in range(2):
            _step(kind, False, inputs, **options)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grads = _step(kind, False, inputs, **options)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sync_debug_mode():
    """torch's own sync detector agrees for the logits-level loss: no sync with the checks off."""
    inputs = _inputs(3)
    _step("grpo_loss", False, inputs, loss_type="dapo")  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step("grpo_loss", False, inputs, loss_type="dapo")
    finally:
        torch.cuda.set_sync_debug_mode("default")

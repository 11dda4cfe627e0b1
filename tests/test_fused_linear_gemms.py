"""The fused lm_head's GEMMs: on the CUDA branch none of a bf16 call upcasts its operands (tensor cores), dW is
accumulated in float32, and the numbers still match the float64 oracle.

No GPU is needed: the branch is chosen by `fused_linear.gemm_mode`, which the tests force, and a dispatch mode
records every matmul-family op with its operand dtypes. CPU has no kernel for `mm`/`addmm` with `out_dtype`, so
the mode computes those (and only those) itself, as cuBLAS does: the bf16 products exactly, summed in float32.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk
from grpo_kernels.engine import memory
from grpo_kernels.kernels import fused_linear
from tests.conftest import BACKENDS
from tests.test_fused_linear import CHUNK, H, V, check, leaves, make

aten = torch.ops.aten
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addmm_, aten.matmul, aten._scaled_mm, aten.addbmm}
OUT_DTYPE = {aten.mm.dtype, aten.mm.dtype_out, aten.addmm.dtype, aten.addmm.dtype_out}
LOW = (torch.bfloat16, torch.float16)


class GemmLog(TorchDispatchMode):
    """Records (op, operand dtypes, out_dtype, output dtype) of every matmul-family op; computes the out_dtype
    overloads itself where the device has no kernel for them (CPU)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...], torch.dtype | None, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in GEMMS:
            return func(*args, **kwargs)
        first = 1 if func.overloadpacket in (aten.addmm, aten.addmm_, aten.baddbmm, aten.addbmm) else 0
        operands = tuple(a.dtype for a in args[first : first + 2])
        out_dtype = None
        if func in OUT_DTYPE:  # mm.dtype(self, mat2, out_dtype), addmm.dtype(self, mat1, mat2, out_dtype)
            index = first + 2
            out_dtype = args[index] if len(args) > index else kwargs["out_dtype"]
        if func in OUT_DTYPE and args[first].device.type == "cpu":
            result = self._emulate(func, args, kwargs, out_dtype)
        else:
            result = func(*args, **kwargs)
        self.calls.append((str(func), operands, out_dtype, result.dtype))
        return result

    @staticmethod
    def _emulate(func, args, kwargs, out_dtype):
        """What CUDA's kernel computes: bf16/fp16 products exact in float32, accumulated in float32."""
        if func.overloadpacket is aten.mm:
            value = args[0].to(out_dtype) @ args[1].to(out_dtype)
        else:
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            value = beta * args[0].to(out_dtype) + alpha * (args[1].to(out_dtype) @ args[2].to(out_dtype))
        out = kwargs.get("out")
        return value if out is None else out.copy_(value)


# (loss options, GEMMs per chunk): a token-level loss forms its gradients in the forward (3); a sequence-level one
# (GSPO) and the log-probs recompute each chunk's logits in the backward (4)
KINDS = {
    "dapo": (dict(loss_type="dapo"), 3),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence"), 4),
    "logprobs": (None, 4),
}


def run(kind: str, backend: str, dtype: torch.dtype, mode: str, monkeypatch):
    """Forward and backward of a fused-linear call under `gemm_mode` = mode; (output, params, inputs, options, log)."""
    monkeypatch.setattr(fused_linear, "gemm_mode", lambda device: mode)
    inputs = make(dtype)
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    options = {**KINDS[kind][0], "beta": 0.04} if kind != "logprobs" else {}
    with GemmLog() as log:
        if kind == "logprobs":
            out = gk.fused_linear_token_logprobs(
                p["hidden"], p["weight"], args[0], bias=p["bias"], mask=args[4], chunk_size=CHUNK, backend=backend
            )
            (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
        else:
            out = gk.fused_linear_grpo_loss(
                p["hidden"], p["weight"], *args, bias=p["bias"], chunk_size=CHUNK, backend=backend, **options
            )
            out.loss.backward()
    return out, p, inputs, options, log.calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_branch_keeps_bf16_operands(kind, backend, monkeypatch):
    """On the CUDA branch ("out_dtype") every GEMM of a bf16 call reads bf16 operands; dW is one addmm per chunk
    with out_dtype=float32 into the float32 accumulator; loss and every gradient match the float64 oracle."""
    out, p, inputs, options, calls = run(kind, backend, torch.bfloat16, "out_dtype", monkeypatch)
    assert calls, "no GEMM recorded"
    for name, operands, _, _ in calls:
        assert operands == (torch.bfloat16, torch.bfloat16), f"{name} read {operands}: an upcast GEMM"
    chunks = -(-int(inputs["mask"].sum()) // CHUNK)
    dw = [c for c in calls if c[2] is not None]
    assert len(dw) == chunks and all(c[0] == "aten.addmm.dtype_out" and c[2] == c[3] == torch.float32 for c in dw)
    assert len(calls) == KINDS[kind][1] * chunks
    if kind != "logprobs":
        check(out.loss, out.metrics, p, inputs, torch.bfloat16, **options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounded_branch_keeps_bf16_operands(backend, monkeypatch):
    """Older torch on CUDA ("rounded"): each chunk's dW product is a bf16 GEMM added to the float32 accumulator;
    still no float32 operand, and the numbers still match the oracle."""
    out, p, inputs, options, calls = run("dapo", backend, torch.bfloat16, "rounded", monkeypatch)
    for name, operands, out_dtype, _ in calls:
        assert operands == (torch.bfloat16, torch.bfloat16) and out_dtype is None, name
    check(out.loss, out.metrics, p, inputs, torch.bfloat16, **options)


def test_cpu_branch_upcasts_only_dw(monkeypatch):
    """CPU ("upcast", the numbers it always had): logits and dH are bf16 GEMMs, dW a float32 one."""
    _, _, _, _, calls = run("dapo", "torch", torch.bfloat16, "upcast", monkeypatch)
    low = [c for c in calls if c[1] == (torch.bfloat16, torch.bfloat16)]
    high = [c for c in calls if c[1] == (torch.float32, torch.float32)]
    assert len(low) == 2 * len(high) and len(low) + len(high) == len(calls)


@pytest.mark.parametrize("mode", ("out_dtype", "rounded", "upcast"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_full_precision_is_never_cast(mode, dtype, monkeypatch):
    """float32 / float64 operands go into a plain addmm_ of their own dtype (float64 accumulates in float64)."""
    acc = torch.zeros(V, H, dtype=dtype)
    a, b = torch.randn(V, 4, dtype=dtype), torch.randn(4, H, dtype=dtype)
    with GemmLog() as log:
        fused_linear.accumulate(acc, a, b, mode)
    assert [c[1] for c in log.calls] == [(dtype, dtype)]
    torch.testing.assert_close(acc, a @ b)


def test_out_dtype_call_is_valid_for_torch():
    """The exact call of the CUDA branch, on meta tensors: torch accepts a float32 accumulator, bf16 operands and
    out_dtype=float32 (the meta kernel checks shapes and dtypes as the CUDA one does)."""
    if not fused_linear._has_out_dtype():
        pytest.skip("this torch has no addmm out_dtype overload (torch < 2.8): the 'rounded' branch is used")
    acc = torch.zeros(V, H, dtype=torch.float32, device="meta")
    a = torch.empty(V, 8, dtype=torch.bfloat16, device="meta")
    b = torch.empty(8, H, dtype=torch.bfloat16, device="meta")
    fused_linear.accumulate(acc, a, b, "out_dtype")
    assert acc.dtype == torch.float32 and acc.shape == (V, H)


def test_rounded_blocks_cover_every_row(monkeypatch):
    """The rounded branch's blocks of dW rows add up to the whole product."""
    monkeypatch.setattr(fused_linear, "ROUNDED_BLOCK", 5)
    acc = torch.zeros(V, H)
    a, b = torch.randn(V, 3).bfloat16(), torch.randn(3, H).bfloat16()
    fused_linear.accumulate(acc, a, b, "rounded")
    torch.testing.assert_close(acc, (a @ b).float())


def test_chunk_budget_uses_the_logits_dtype(monkeypatch):
    """Rows per chunk come from the real logits dtype: bf16 chunks hold twice the rows of float32 ones where no
    float32 copy is made (CUDA), and the CPU budget counts its float32 copies."""
    rows = lambda dtype: memory.chunk_rows(10**6, 32000, 4096, torch.device("cpu"), None, dtype)  # noqa: E731
    monkeypatch.setattr(memory, "CPU_CHUNK_ROWS", 10**6)
    cpu32, cpu16 = rows(torch.float32), rows(torch.bfloat16)
    assert cpu32 == memory.CPU_CHUNK_BYTES // (4 * (32000 + 4096))
    assert cpu16 == memory.CPU_CHUNK_BYTES // (6 * (32000 + 4096))
    monkeypatch.setattr(fused_linear, "gemm_mode", lambda device: "out_dtype")
    assert rows(torch.bfloat16) == memory.CPU_CHUNK_BYTES // (2 * (32000 + 4096))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_cuda_gemms_on_the_gpu(dtype):
    """On a GPU, unforced: the branch is out_dtype (torch >= 2.8), the dW accumulation runs on the device's own
    kernel and matches float64, and a fused-linear bf16 call's GEMMs read only low-precision operands."""
    device = torch.device("cuda")
    assert fused_linear.gemm_mode(device) == ("out_dtype" if fused_linear._has_out_dtype() else "rounded")
    acc = torch.zeros(512, 256, device=device)
    a, b = torch.randn(512, 1024, device=device, dtype=dtype), torch.randn(1024, 256, device=device, dtype=dtype)
    fused_linear.accumulate(acc, a, b, fused_linear.gemm_mode(device))
    exact = a.double() @ b.double()
    assert (acc.double() - exact).abs().max() <= 1e-4 * exact.abs().max()
    inputs = make(dtype)
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    with GemmLog() as log:
        out = gk.fused_linear_grpo_loss(p["hidden"], p["weight"], *args, bias=p["bias"], chunk_size=CHUNK)
        out.loss.backward()
    assert log.calls and all(c[1] == (dtype, dtype) for c in log.calls), log.calls


def test_refused_out_dtype_falls_back_to_rounded(monkeypatch):
    """A torch whose CUDA addmm(out_dtype) refuses a float32 accumulator (an early kernel's dtype check) gets the
    rounded bf16 products, with a warning, for this and every later call; other errors still raise."""
    monkeypatch.setattr(fused_linear, "_OUT_DTYPE_REFUSED", [])

    def refuse(*args, **kwargs):
        raise RuntimeError("self and mat2 must have the same dtype, but got Float and BFloat16")

    monkeypatch.setattr(torch, "addmm", refuse)
    acc = torch.zeros(V, H)
    a, b = torch.randn(V, 3).bfloat16(), torch.randn(3, H).bfloat16()
    with pytest.warns(UserWarning, match="rounded to the input dtype"):
        fused_linear.accumulate(acc, a, b, "out_dtype")
    fused_linear.accumulate(acc, a, b, "out_dtype")  # no second try
    torch.testing.assert_close(acc, 2 * (a @ b).float())
    assert fused_linear.gemm_mode(torch.device("cuda")) == "rounded"
    fused_linear._has_out_dtype.cache_clear()

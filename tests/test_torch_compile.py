"""`torch.compile` over a small model and `grpo_loss` / `fused_linear_grpo_loss`: the same loss and gradients as eager,
and the graph breaks counted.

With check_finite=False (the capture-friendly mode; memory="auto") a call compiles whole, 0 graph breaks, measured with
torch 2.13: the loss options are built from a constant list of names, the value-check block keeps its queue where the
compiler sees it, the free host memory (memory="auto") and a backend module's import are read once while tracing, the
torch pass takes every row's logsumexp where its target's log-prob is below −32 instead of reading that test on the
host, and the fused lm_head runs every row masked instead of reading the kept-row count. With check_finite=True the
value checks' one host read is the one break (the pass's row check, a second read in eager, gives way under compile to
the unchecked mode's NaN loss over a non-finite row). Inductor compiles every graph with the host C++ compiler, so its
test costs about a minute of CPU on two cores, whatever the model's size; the count test compiles with "aot_eager" (no
code generated). The model is the smallest that has an embedding, a layer and a head.
"""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.kernels import backend as backends

GRAPH_BREAKS = 0  # the measured count above: a new break fails the test
B, T, V, H = 2, 4, 32, 16


def _problem(function: str = "fused_linear_grpo_loss", check_finite: bool = False, backend: str = "torch"):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        dict(embed=torch.nn.Embedding(V, H), layer=torch.nn.Linear(H, H), head=torch.nn.Linear(H, V, bias=False))
    )
    ids = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    advantages = torch.randn(B)
    old_logp = -torch.rand(B, T) - 2.0
    ref_logp = old_logp + 0.05
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3] = False

    def step(ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(model["layer"](model["embed"](ids)))  # [B, T, H]
        keywords = dict(loss_type="dapo", beta=0.04, backend=backend, check_finite=check_finite)
        if function == "grpo_loss":
            logits = hidden @ model["head"].weight.T  # [B, T, V]
            return gk.grpo_loss(logits, targets, advantages, old_logp, ref_logp, mask, **keywords).loss
        weight = model["head"].weight
        return gk.fused_linear_grpo_loss(hidden, weight, targets, advantages, old_logp, ref_logp, mask, **keywords).loss

    return model, ids, step


def _graph_breaks_against_eager(model, ids, step, compile_step) -> tuple[int, str]:
    """Run `step` eagerly and `compile_step(step)`, forward and backward: the same loss and gradients; the graph
    breaks counted while compiling, and their reasons."""
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    params = list(model.parameters())
    eager_loss = step(ids)
    eager_grads = torch.autograd.grad(eager_loss, params)
    dynamo.reset()
    counters.clear()
    loss = compile_step(step)(ids)
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-7)
    for name, got, want in zip(("embed", "layer.weight", "layer.bias", "head"), grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"grad {n}: {m}")
    breaks = sum(counters["graph_break"].values())
    reasons = "\n".join(f"{n} x {r.splitlines()[0]}" for r, n in counters["graph_break"].items())
    dynamo.reset()
    return breaks, reasons


def test_inductor_matches_eager_and_counts_graph_breaks(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no cache of an earlier run
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool to start on a 2-core machine
        breaks, reasons = _graph_breaks_against_eager(*_problem(), lambda step: torch.compile(step, backend="inductor"))
    assert breaks <= GRAPH_BREAKS, f"{breaks} graph breaks, {GRAPH_BREAKS} measured before:\n{reasons}"


@pytest.mark.parametrize("check_finite", [False, True])
@pytest.mark.parametrize("function", ["grpo_loss", "fused_linear_grpo_loss"])
def test_compiled_call_matches_eager_and_counts_graph_breaks(function, check_finite):
    dynamo = pytest.importorskip("torch._dynamo")
    # checked, the value checks' one host read is the graph's one break; by default the compiler counts it once per
    # frame it is nested in (the step, the public function, the plan builder: 3), resumed inside the frame, once
    with dynamo.config.patch(nested_graph_breaks=check_finite):
        breaks, reasons = _graph_breaks_against_eager(
            *_problem(function, check_finite), lambda step: torch.compile(step, backend="aot_eager")
        )
    expected = 1 if check_finite else 0
    assert breaks <= expected, f"{breaks} graph breaks, {expected} measured before:\n{reasons}"


@pytest.mark.parametrize("check_finite", [False, True])
@pytest.mark.parametrize("function", ["grpo_loss", "fused_linear_grpo_loss"])
def test_compiled_triton_call_matches_eager_and_counts_graph_breaks(function, check_finite):
    """backend="triton" (on CPU tensors, the interpreter): every launch is a custom op with a fake
    (kernels/triton/ops.py), one opaque node of the graph, so the counts are the torch backend's: 0, and the value
    checks' one host read with check_finite=True. grpo_loss takes the fused epilogue's op here."""
    dynamo = pytest.importorskip("torch._dynamo")
    pytest.importorskip("triton")
    ok, why = backends.CAPABILITIES["triton"].usable(torch.empty(0).device)
    if not ok:
        pytest.skip(why)
    with dynamo.config.patch(nested_graph_breaks=check_finite):
        breaks, reasons = _graph_breaks_against_eager(
            *_problem(function, check_finite, "triton"), lambda step: torch.compile(step, backend="aot_eager")
        )
    expected = 1 if check_finite else 0
    assert breaks <= expected, f"{breaks} graph breaks, {expected} measured before:\n{reasons}"

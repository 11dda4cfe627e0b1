"""`torch.compile` (inductor, CPU) over a small model and `fused_linear_grpo_loss`: the same loss and gradients as
eager, and the graph breaks counted.

Measured with torch 2.13 (check_finite=False, the capture-friendly mode; memory="auto"): 12 graph breaks. Where:
`LossOptions` built from a dataclass (2), `ContextVar.set` / `get` (4), builtins dynamo skips (3: `os.sysconf` asking
the free memory for memory="auto", a backend module's first import), and the torch pass's test of whether every
row's target log-prob is above −32 before it trusts lse = z_target − log q_target (3: a host read per pass, as in
eager). Each is a graph boundary, not a wrong result. Inductor compiles every graph with the host C++ compiler, so
the test costs about a minute of CPU on two cores, whatever the model's size; the model here is the smallest that has
an embedding, a layer and a head.
"""

import pytest
import torch

import grpo_kernels as gk

GRAPH_BREAKS = 12  # the measured count above: a new break fails the test; one fewer, update the number and list
B, T, V, H = 2, 4, 32, 16


def _problem():
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
        out = gk.fused_linear_grpo_loss(
            hidden, model["head"].weight, targets, advantages, old_logp, ref_logp, mask,
            loss_type="dapo", beta=0.04, backend="torch", check_finite=False,
        )  # fmt: skip
        return out.loss

    return model, ids, step


def test_inductor_matches_eager_and_counts_graph_breaks(tmp_path, monkeypatch):
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no cache of an earlier run
    model, ids, step = _problem()
    params = list(model.parameters())
    eager_loss = step(ids)
    eager_grads = torch.autograd.grad(eager_loss, params)
    dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool to start on a 2-core machine
        compiled = torch.compile(step, backend="inductor")
        loss = compiled(ids)
        grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-7)
    for name, got, want in zip(("embed", "layer.weight", "layer.bias", "head"), grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"grad {n}: {m}")
    breaks = sum(counters["graph_break"].values())
    reasons = "\n".join(f"{n} x {r.splitlines()[0]}" for r, n in counters["graph_break"].items())
    assert breaks <= GRAPH_BREAKS, f"{breaks} graph breaks, {GRAPH_BREAKS} measured before:\n{reasons}"
    dynamo.reset()

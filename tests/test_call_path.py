"""One call's path through the package is short: a public call builds its plan once, enters `engine/layout.py` once
and no other engine file more than twice.

The measure: run the call under `sys.setprofile`; every "call" event whose frame's file is inside the package and
whose caller's file is another file is an entry into that file. Entries are counted per file over one whole call
(after a first, untraced one: imports and caches are not the call's path).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk

PACKAGE = Path(gk.__file__).resolve().parent
B, T, V, H = 2, 5, 11, 8


def entries(call) -> tuple[collections.Counter, int]:
    """Entries per file (package-relative path) during `call()`, and how many times the plan builder ran."""
    counted: collections.Counter = collections.Counter()
    builds = 0

    def profile(frame, event, arg):
        nonlocal builds
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE not in path.parents:
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if caller != frame.f_code.co_filename:
            counted[path.relative_to(PACKAGE).as_posix()] += 1
        if frame.f_code.co_name == "build_plan" and path.name == "plan.py":
            builds += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return counted, builds


def _call(name: str, backward: bool, **replay):
    torch.manual_seed(0)
    master = torch.randn(B, T, V)
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    old_logp, advantages = torch.randn(B, T), torch.randn(B)

    def call() -> None:
        logits = master.clone().requires_grad_()  # the in-place backward consumes the logits
        if name == "grpo_loss":
            out = gk.grpo_loss(logits, targets, advantages, old_logp, mask=mask, beta=0.0, backend="torch", **replay)
            out = out.loss
        elif name == "fused_linear_grpo_loss":
            out = gk.fused_linear_grpo_loss(
                hidden, weight, targets, advantages, old_logp, mask=mask, backend="torch", **replay
            ).loss
        else:
            out = gk.token_logprobs(logits, targets, backend="torch").sum()
        if backward:
            out.backward()

    return call


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("name", ["grpo_loss", "fused_linear_grpo_loss", "token_logprobs"])
def test_one_call_enters_each_engine_file_at_most_twice(name, backward):
    call = _call(name, backward)
    call()  # first call: lazy imports and caches
    counted, builds = entries(call)
    engine = {path: n for path, n in counted.items() if path.startswith("engine/")}
    assert builds == 1
    assert engine["engine/layout.py"] == 1, engine
    assert max(engine.values()) <= 2, engine


@pytest.mark.parametrize(
    ("name", "replay", "most"),
    [("grpo_loss", {}, 12), ("fused_linear_grpo_loss", {}, 22), ("grpo_loss", {"top_p": 0.9}, 16)],
    ids=["grpo_loss", "fused_linear_grpo_loss", "grpo_loss-top_p"],
)
def test_one_call_enters_the_kernels_few_times(name, replay, most):
    """Forward and backward, the kernels' files are entered at most `most` times in all: one driver per source, its
    steps (sharding, replay) called from its loop, not a Function each."""
    call = _call(name, True, **replay)
    call()
    counted, _ = entries(call)
    kernels = {path: n for path, n in counted.items() if path.startswith("kernels/")}
    assert sum(kernels.values()) <= most, kernels


def test_the_measure_sees_a_path_that_comes_back(monkeypatch):
    """An entry is counted each time the path comes back into a file: a second call into layout.py is seen."""
    from grpo_kernels.engine import inputs, layout

    padded = inputs.padded

    def padded_calling_back(lay, x, fill=0):
        return layout.all_rows(True, x.device) or padded(lay, x, fill)

    monkeypatch.setattr(inputs, "padded", padded_calling_back)
    call = _call("grpo_loss", False)
    call()
    counted, _ = entries(call)
    assert counted["engine/layout.py"] > 1

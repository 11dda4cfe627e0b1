"""The host's time per call of the four public functions, at shapes so small that the kernels cost nothing: what the
Python layers (checks, flattening, backend dispatch, autograd) add to every call.

    python -m benchmarks.host_overhead                       # CPU, torch backend, the table on stdout
    python -m benchmarks.host_overhead --device cuda --backend triton --json FILE

Each function runs forward (inputs that need no gradient) and forward + backward (leaves that do; the log-prob
passes back-propagate logp.sum() + entropy.sum()), with `check_finite` on and off. Shapes: B 4 × T 8 × V 16 for
`token_logprobs` and `grpo_loss`; the same rows with H 16 and a [16, 16] lm_head for the fused ones. A number is the
minimum over `--repeats` calls, each timed alone (the device synchronised after it; the logits the in-place
backward overwrote are restored between calls, untimed), after `--warmup` calls; the median is in the JSON. torch
runs one intra-op thread (`--threads`): at these sizes more only adds wake-ups, and on a shared CPU a call could
wait tens of milliseconds for the pool's other thread.

A second table counts the ops one call sends through torch's dispatcher (forward and, for fwd+bwd, the backward the
autograd engine runs): at these shapes each costs a few microseconds of host time whatever the machine, so the
count is a machine-independent proxy for the time, where the time itself drifts with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk

B, T, V, H = 4, 8, 16, 16
FUNCTIONS = ("token_logprobs", "fused_linear_token_logprobs", "grpo_loss", "fused_linear_grpo_loss")
LOSS = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)


def _inputs(device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    x = dict(
        logits=torch.randn(B, T, V, generator=g),
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(V, H, generator=g) / H**0.5,
        targets=torch.randint(0, V, (B, T), generator=g),
        advantages=torch.randn(B, generator=g),
        mask=torch.rand(B, T, generator=g) > 0.2,
    )
    x["old_logp"] = -torch.rand(B, T, generator=g) - 2.0
    x["ref_logp"] = x["old_logp"] + 0.05 * torch.randn(B, T, generator=g)
    return {k: v.to(device) for k, v in x.items()}


def make_call(name: str, x: dict, backward: bool, check_finite: bool, backend: str) -> tuple[Callable, Callable]:
    """(call, restore): one call of `name`; `restore` puts back what the call overwrote (untimed)."""
    fused = name.startswith("fused_linear")
    masters = [x["hidden"], x["weight"]] if fused else [x["logits"]]
    leaves = [m.clone().requires_grad_(backward) for m in masters]
    kw = dict(backend=backend, check_finite=check_finite)
    policy = [x[k] for k in ("advantages", "old_logp", "ref_logp", "mask")]

    def call() -> None:
        if name.endswith("grpo_loss"):
            out = getattr(gk, name)(*leaves, x["targets"], *policy, **LOSS, **kw)
            if backward:
                out.loss.backward()
        else:
            logp, entropy = getattr(gk, name)(*leaves, x["targets"], mask=x["mask"], with_entropy=True, **kw)
            if backward:
                (logp.sum() + entropy.sum()).backward()

    def restore() -> None:
        with torch.no_grad():
            for leaf, master in zip(leaves, masters, strict=True):
                leaf.copy_(master)  # the in-place backward wrote dL/dlogits into the logits
                leaf.grad = None

    return call, restore


def time_call(call: Callable, restore: Callable, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of `repeats` calls, after `warmup` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        restore()
        sync()
        start = time.perf_counter()
        call()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


class _OpCount(TorchDispatchMode):
    """Counts the ops that reach the dispatcher while active."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(call: Callable, restore: Callable) -> int:
    """The ops one call (after a first, uncounted one) sends through torch's dispatcher."""
    restore()
    call()
    restore()
    with _OpCount() as counted:
        call()
    return counted.ops


def measure(device: torch.device, backend: str, repeats: int, warmup: int) -> list[dict]:
    x = _inputs(device)
    rows = []
    for name in FUNCTIONS:
        for backward in (False, True):
            for check_finite in (True, False):
                call, restore = make_call(name, x, backward, check_finite, backend)
                times = time_call(call, restore, device, repeats, warmup)
                rows.append(
                    dict(function=name, mode="fwd+bwd" if backward else "fwd", check_finite=check_finite,
                         min_ms=min(times), median_ms=statistics.median(times), ops=count_ops(call, restore))
                )  # fmt: skip
    return rows


def table(rows: list[dict], header: str, column: str = "min_ms", number: str = "{:.3f}") -> str:
    cell = {(r["function"], r["mode"], r["check_finite"]): r[column] for r in rows}
    out = [header, "", "| function | fwd, checks on | fwd, checks off | fwd+bwd, checks on | fwd+bwd, checks off |"]
    out.append("|---|---|---|---|---|")
    for name in FUNCTIONS:
        cells = [number.format(cell[name, mode, check]) for mode in ("fwd", "fwd+bwd") for check in (True, False)]
        out.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="torch", choices=("torch", "triton", "cuda", "auto"))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads take a count >= 1, --warmup one >= 0")
    device, threads = torch.device(args.device), torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = measure(device, args.backend, args.repeats, args.warmup)
    finally:
        torch.set_num_threads(threads)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    header = (
        f"Host time per call, ms (min of {args.repeats} calls), {where}, torch {torch.__version__}, "
        f"backend {args.backend}, {args.threads} thread(s); B {B} × T {T} × V {V} (fused: H {H})"
    )
    print(table(rows, header))
    print()
    print(table(rows, "Ops per call through torch's dispatcher (a machine-independent proxy)", "ops", "{}"))
    if args.json:
        meta = dict(device=where, torch=torch.__version__, backend=args.backend, threads=args.threads)
        meta["shape"] = dict(B=B, T=T, V=V, H=H)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(meta, repeats=args.repeats, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()

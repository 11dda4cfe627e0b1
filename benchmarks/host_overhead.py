"""The host's time per call of the four public functions, at shapes so small that the kernels cost nothing: what the
Python layers (checks, flattening, backend dispatch, autograd) add to every call.

    python -m benchmarks.host_overhead                       # CPU, torch backend, the tables on stdout
    python -m benchmarks.host_overhead --device cuda --backend triton --json FILE
    python -m benchmarks.host_overhead --against OLD_CHECKOUT    # before and after, in one run

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

On CUDA, a further table gives each call's device time (torch.profiler's kernels and copies, less the restore's):
the wall time beyond it is what the host adds. Another times the peers of `benchmarks.host_peers` (plain eager
torch, TRL 1.16, Liger; none of them checks its inputs, and the eager ones log no metrics) on the same inputs, with
ours as a multiple of each. `--against` instead times the package of another checkout and this one, each in a fresh
interpreter, alternating for `--rounds`: the before and after of a change, measured in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
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


def _leaves(name: str, x: dict, backward: bool) -> tuple[list[Tensor], Callable]:
    """The differentiable inputs of `name` (the logits, or hidden and weight), fresh copies, and `restore`: it puts
    back what a call overwrote (the in-place backward writes dL/dlogits into the logits) and drops the gradients."""
    masters = [x["hidden"], x["weight"]] if name.startswith("fused_linear") else [x["logits"]]
    leaves = [m.clone().requires_grad_(backward) for m in masters]

    def restore() -> None:
        with torch.no_grad():
            for leaf, master in zip(leaves, masters, strict=True):
                leaf.copy_(master)
                leaf.grad = None

    return leaves, restore


def _backward(out) -> None:
    """Back-propagate a call's result: a loss (a 0-dim tensor or an output with `.loss`), or logp.sum() +
    entropy.sum() for a (logp, entropy) pair."""
    if isinstance(out, tuple) and not hasattr(out, "loss"):
        (out[0].sum() + out[1].sum()).backward()
    else:
        getattr(out, "loss", out).backward()


def make_call(name: str, x: dict, backward: bool, check_finite: bool, backend: str) -> tuple[Callable, Callable]:
    """(call, restore): one call of `name`; `restore` puts back what the call overwrote (untimed)."""
    leaves, restore = _leaves(name, x, backward)
    kw = dict(backend=backend, check_finite=check_finite)
    policy = [x[k] for k in ("advantages", "old_logp", "ref_logp", "mask")]

    def call() -> None:
        if name.endswith("grpo_loss"):
            out = getattr(gk, name)(*leaves, x["targets"], *policy, **LOSS, **kw)
        else:
            out = getattr(gk, name)(*leaves, x["targets"], mask=x["mask"], with_entropy=True, **kw)
        if backward:
            _backward(out)

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


def device_time(call: Callable, restore: Callable, repeats: int) -> float:
    """Milliseconds of device activity (kernels, copies) per call on CUDA, from torch.profiler's CUDA activity, less
    what `restore` launches: set against the call's wall time, what the host adds."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def per_call(body: Callable) -> float:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                body()
            torch.cuda.synchronize()
        device_us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
        return device_us / 1e3 / repeats

    def restore_and_call() -> None:
        restore()
        call()

    return per_call(restore_and_call) - per_call(restore)


def _row(call: Callable, restore: Callable, device: torch.device, repeats: int, warmup: int, **key) -> dict:
    times = time_call(call, restore, device, repeats, warmup)
    row = dict(key, min_ms=min(times), median_ms=statistics.median(times), ops=count_ops(call, restore))
    if device.type == "cuda":
        row["device_ms"] = device_time(call, restore, min(repeats, 20))
    return row


def measure(device: torch.device, backend: str, repeats: int, warmup: int) -> list[dict]:
    x = _inputs(device)
    rows = []
    for name in FUNCTIONS:
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            for check_finite in (True, False):
                call, restore = make_call(name, x, backward, check_finite, backend)
                key = dict(function=name, mode=mode, check_finite=check_finite)
                rows.append(_row(call, restore, device, repeats, warmup, **key))
    return rows


def table(rows: list[dict], header: str, column: str = "min_ms", number: str = "{:.3f}") -> str:
    cell = {(r["function"], r["mode"], r["check_finite"]): r[column] for r in rows}
    out = [header, "", "| function | fwd, checks on | fwd, checks off | fwd+bwd, checks on | fwd+bwd, checks off |"]
    out.append("|---|---|---|---|---|")
    for name in FUNCTIONS:
        cells = [number.format(cell[name, mode, check]) for mode in ("fwd", "fwd+bwd") for check in (True, False)]
        out.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(out)


def measure_peers(device: torch.device, repeats: int, warmup: int) -> list[dict]:
    """The peers of `benchmarks.host_peers`, timed as the four functions are; a row with `why_not` for a peer that
    cannot run here."""
    from benchmarks.host_peers import peers

    x = _inputs(device)
    rows = []
    for name, row in peers(LOSS, device).items():
        for peer, fn, why_not in row:
            if why_not is not None:
                rows.append(dict(function=name, peer=peer, why_not=why_not))
                continue
            for backward in (False, True):
                leaves, restore = _leaves(name, x, backward)

                def call(fn=fn, leaves=leaves, backward=backward) -> None:
                    out = fn(leaves, x)
                    if backward:
                        _backward(out)

                mode = "fwd+bwd" if backward else "fwd"
                rows.append(_row(call, restore, device, repeats, warmup, function=name, peer=peer, mode=mode))
    return rows


def peer_table(rows: list[dict], peer_rows: list[dict]) -> str:
    """Each peer's ms per call, ours (checks on) as a multiple of it, and both op counts."""
    ours = {(r["function"], r["mode"]): r for r in rows if r["check_finite"]}
    theirs = {(r["function"], r["peer"], r["mode"]): r for r in peer_rows if "why_not" not in r}
    out = ["Peers in the same run (unchecked; eager: no metrics): ms per call, and ours (checks on) ÷ the peer's", ""]
    out += ["| function | peer | fwd | ours ÷ peer | fwd+bwd | ours ÷ peer | ops fwd, fwd+bwd: peer (ours) |"]
    out.append("|---|---|---|---|---|---|---|")
    for r in peer_rows:
        if "why_not" in r:
            out.append(f"| {r['function']} | {r['peer']}: {r['why_not']} | | | | | |")
        elif r["mode"] == "fwd":
            cells, ops = [], []
            for mode in ("fwd", "fwd+bwd"):
                peer, mine = theirs[r["function"], r["peer"], mode], ours[r["function"], mode]
                cells.append(f"{peer['min_ms']:.3f} | {mine['min_ms'] / peer['min_ms']:.2f}×")
                ops.append(f"{peer['ops']} ({mine['ops']})")
            out.append(f"| {r['function']} | {r['peer']} | {' | '.join(cells)} | {', '.join(ops)} |")
    return "\n".join(out)


def run_checkout(tree: Path, args: argparse.Namespace) -> list[dict]:
    """The rows of this script run in a fresh interpreter on the package of the checkout `tree`, no peers."""
    flags = ["--device", args.device, "--backend", args.backend, "--repeats", str(args.repeats)]
    flags += ["--warmup", str(args.warmup), "--threads", str(args.threads), "--no-peers"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        # this file run as a script from `tree`: the package imported is the checkout's, whatever this one's path
        run = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
        command = [sys.executable, "-c", run, str(Path(__file__).resolve()), *flags, "--json", str(out)]
        env = dict(os.environ, PYTHONPATH=str(tree))
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: the run on {tree} failed:\n{done.stderr.strip()}")
        result = json.loads(out.read_text())
    if Path(result["package"]).resolve() != (tree / "grpo_kernels").resolve():
        raise SystemExit(f"error: the run on {tree} imported {result['package']}")
    return result["rows"]


def before_after(args: argparse.Namespace) -> tuple[str, dict]:
    """`--against`: the checkout given and this one, run alternately `--rounds` times; each cell the lower of its
    rounds. Returns the table and, for the JSON, both sides' rows."""
    here = Path(__file__).resolve().parents[1]
    sides: dict[str, list[list[dict]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        sides["before"].append(run_checkout(args.against, args))
        sides["after"].append(run_checkout(here, args))
    best = {
        side: {
            (r["function"], r["mode"], r["check_finite"]): min(run[i]["min_ms"] for run in runs)
            for i, r in enumerate(runs[0])
        }
        for side, runs in sides.items()
    }
    out = [
        f"Before ({args.against}) and after ({here}), ms per call, the lower of {args.rounds} alternating rounds",
        "",
        "| function | checks | fwd: before | after | after ÷ before | fwd+bwd: before | after | after ÷ before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in FUNCTIONS:
        for check in (True, False):
            cells = []
            for mode in ("fwd", "fwd+bwd"):
                old, new = best["before"][name, mode, check], best["after"][name, mode, check]
                cells.append(f"{old:.3f} | {new:.3f} | {new / old:.2f}×")
            out.append(f"| {name} | {'on' if check else 'off'} | {' | '.join(cells)} |")
    return "\n".join(out), sides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="torch", choices=("torch", "triton", "cuda", "auto"))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine here")
    parser.add_argument("--no-peers", action="store_true", help="time the four functions alone")
    parser.add_argument(
        "--against", type=Path, metavar="CHECKOUT", help="before and after: time a checkout's package and this one"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of --against (default 2)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads take a count >= 1, --warmup one >= 0")
    if args.against is not None and not (args.against / "grpo_kernels" / "__init__.py").is_file():
        parser.error(f"--against: {args.against} is not a checkout of grpo-kernels (no grpo_kernels/__init__.py)")
    if args.rounds < 1:
        parser.error("--rounds takes a count >= 1")
    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__)
    meta.update(backend=args.backend, threads=args.threads, repeats=args.repeats, shape=dict(B=B, T=T, V=V, H=H))
    if args.against is not None:
        text, sides = before_after(args)
        print(text)
        _write(args.json, dict(meta, **sides), [text])
        return
    device, threads = torch.device(args.device), torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = measure(device, args.backend, args.repeats, args.warmup)
        peer_rows = [] if args.no_peers else measure_peers(device, args.repeats, args.warmup)
    finally:
        torch.set_num_threads(threads)
    header = (
        f"Host time per call, ms (min of {args.repeats} calls), {meta['device']}, torch {torch.__version__}, "
        f"backend {args.backend}, {args.threads} thread(s); B {B} × T {T} × V {V} (fused: H {H})"
    )
    tables = [table(rows, header)]
    if device.type == "cuda":
        tables.append(table(rows, "Device time per call (torch.profiler: kernels and copies), ms", "device_ms"))
    tables.append(table(rows, "Ops per call through torch's dispatcher (a machine-independent proxy)", "ops", "{}"))
    if peer_rows:
        tables.append(peer_table(rows, peer_rows))
    print("\n\n".join(tables))
    _write(args.json, dict(meta, package=str(Path(gk.__file__).parent), rows=rows, peers=peer_rows), tables)


def _write(path: Path | None, result: dict, tables: list[str] = ()) -> None:
    """The JSON at `path`, and the tables beside it (the same name, .md)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        if tables:
            path.with_suffix(".md").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()

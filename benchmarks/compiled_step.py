"""The public API's share of the vocabulary kernels' bandwidth, eager against `torch.compile(mode="reduce-overhead")`,
on the Triton backend: how much of a call's wall time its kernels fill once the host work is compiled into a graph
and the graph replayed as a CUDA graph.

    python -m benchmarks.compiled_step --out DIR                # CUDA: bf16, N 8,192 (B 16 × T 512), V 151,936
    python -m benchmarks.compiled_step --size smoke --out DIR   # any machine, tiny: the code path, no meaningful number

Calls (check_finite=False in both modes, the capture-friendly mode; the value checks' host read would break the
graph): `token_logprobs` forward with the entropy (the logits read once) and `grpo_loss` forward + backward (dapo,
beta 0.04, inplace=False so that the compiled graph writes no input: logits read, then read and the gradient written).
Kernel time: the eager call under the profiler, the device time of the kernels whose name holds `_kernel`
(`headline.kernel_ms`); wall time: the median over --rounds of --iters back-to-back calls, synchronised at both ends,
per call. share = kernel ms / wall ms: the public API's bandwidth over its kernels'. The smoke size runs on the CPU
through Triton's interpreter, compiled with the "aot_eager" backend (Inductor would compile C++ for a minute, and a
CUDA graph needs CUDA); it has no kernel time and no share.

Writes DIR/compiled_step.json and DIR/compiled_step.md after every case (a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SIZES = {
    "gpu": dict(B=16, T=512, V=151_936, dtype=torch.bfloat16, compile=dict(mode="reduce-overhead"), warmups=3),
    "smoke": dict(B=1, T=4, V=64, dtype=torch.float32, compile=dict(backend="aot_eager"), warmups=1),
}
OPTIONS = dict(loss_type="dapo", epsilon_high=0.28, beta=0.04, backend="triton", check_finite=False)


def problem(size: dict, device: torch.device) -> dict:
    """logits [B, T, V], targets, ~12% of the tokens masked, advantages, old/ref log-probs near the policy's."""
    B, T, V = size["B"], size["T"], size["V"]
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(B, T, V, generator=g, device=device) * 2).to(size["dtype"])  # [B, T, V]
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    mask[:, T * 3 // 4 :] = torch.rand(B, 1, generator=g, device=device) > 0.5  # some shorter completions
    targets = torch.randint(0, V, (B, T), generator=g, device=device)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]  # [B, T]
    return dict(
        logits=logits,
        targets=targets,
        mask=mask,
        advantages=torch.randn(B, generator=g, device=device),
        old_logp=logp + 0.02 * torch.randn(B, T, generator=g, device=device),
        ref_logp=logp + 0.02 * torch.randn(B, T, generator=g, device=device),
    )


def calls(p: dict) -> dict[str, tuple[Callable, Callable, int]]:
    """name -> (the public API call that is compiled, one step running a call, the bytes its kernels move)."""
    import grpo_kernels as gk

    nbytes = p["logits"].numel() * p["logits"].element_size()
    policy = [p[k] for k in ("advantages", "old_logp", "ref_logp", "mask")]

    def forward(logits):  # -> (logp, entropy) [B, T]
        return gk.token_logprobs(
            logits, p["targets"], with_entropy=True, mask=p["mask"], backend="triton", check_finite=False
        )

    def forward_step(call):
        with torch.no_grad():
            return call(p["logits"])

    def loss(logits):
        return gk.grpo_loss(logits, p["targets"], *policy, inplace=False, **OPTIONS).loss

    def loss_step(call):
        x = p["logits"].detach().requires_grad_()
        return torch.autograd.grad(call(x), x)  # dL/dlogits [B, T, V]

    return dict(token_logprobs_fwd=(forward, forward_step, nbytes), grpo_loss_fwd_bwd=(loss, loss_step, 3 * nbytes))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(step: Callable[[], object], device: torch.device, iters: int, rounds: int, warmups: int) -> float:
    """Median over `rounds` of the wall time per call of `iters` back-to-back calls, after `warmups` calls (a
    compiled call is traced in the first, then records its CUDA graph)."""

    def call():
        torch.compiler.cudagraph_mark_step_begin()  # each call a new step: the last one's outputs may be reused
        step()

    for _ in range(warmups):
        call()
    sync(device)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(iters):
            call()
        sync(device)
        times.append((time.perf_counter() - began) * 1e3 / iters)
    return statistics.median(times)


def markdown(result: dict) -> str:
    lines = [f"# The public API compiled against eager on {result['device']} (torch {result['torch']}, triton "
             f"{result['triton']})", ""]  # fmt: skip
    lines += [
        f"logits [{result['B']}, {result['T']}, {result['V']:,}] {result['dtype']}; compile {result['compile']}",
        "",
    ]
    lines += ["| call | mode | wall ms per call | kernel ms | share of the kernels' bandwidth | TB/s |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for name, case in result["cases"].items():
        for mode in ("eager", "compiled"):
            r = case.get(mode)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {name} | {mode} | {r['error']} | | | |")
                continue
            kernel = "—" if case["kernel_ms"] is None else f"{case['kernel_ms']:.3f}"
            share = "—" if r["share"] is None else f"{r['share']:.0%}"
            lines.append(f"| {name} | {mode} | {r['wall_ms']:.3f} | {kernel} | {share} | {r['tbps']:.2f} |")
    return "\n".join(lines) + "\n"


def run(size_name: str, iters: int, rounds: int, out: Path, device: torch.device) -> dict:
    import triton

    from benchmarks.headline import kernel_ms

    size = SIZES[size_name]
    result = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        triton=triton.__version__, size=size_name, dtype=str(size["dtype"]), B=size["B"], T=size["T"], V=size["V"],
        compile=json.dumps(size["compile"]), loss=json.dumps(OPTIONS), iters=iters, rounds=rounds, cases={},
    )  # fmt: skip

    def save():
        out.mkdir(parents=True, exist_ok=True)
        (out / "compiled_step.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "compiled_step.md").write_text(markdown(result))

    p = problem(size, device)
    for name, (call, step, nbytes) in calls(p).items():
        case = result["cases"][name] = dict(bytes=nbytes, kernel_ms=kernel_ms(functools.partial(step, call), device))
        compiled = torch.compile(call, dynamic=False, **size["compile"])
        for mode, fn in (("eager", call), ("compiled", compiled)):
            try:
                ms = wall_ms(functools.partial(step, fn), device, iters, rounds, size["warmups"])
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                case[mode] = dict(error=f"{type(error).__name__}: {error}"[:500])
            else:
                share = None if case["kernel_ms"] is None else case["kernel_ms"] / ms
                case[mode] = dict(wall_ms=ms, share=share, tbps=nbytes / (ms / 1e3) / 1e12)
            print(f"{name} {mode}: {case[mode]}", flush=True)
            save()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu" if torch.cuda.is_available() else "smoke")
    parser.add_argument("--iters", type=int, default=20, help="back-to-back calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; their median is reported")
    parser.add_argument("--out", type=Path, required=True, help="folder for compiled_step.json and compiled_step.md")
    args = parser.parse_args(argv)
    if args.size == "gpu" and not torch.cuda.is_available():
        parser.error("--size gpu needs a CUDA device; use --size smoke here")
    for name in ("iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} takes a count >= 1, got {getattr(args, name)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # Triton on CPU tensors runs its interpreter, chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args.size, args.iters, args.rounds, args.out, device)
    print(markdown(result))
    failed = [f"{name} {mode}" for name, case in result["cases"].items() for mode in ("eager", "compiled")
              if "error" in case.get(mode, {})]  # fmt: skip
    if failed:
        print(f"compiled_step: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

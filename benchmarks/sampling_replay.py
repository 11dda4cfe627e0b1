"""What sampling replay costs on the fused lm_head + GRPO loss (forward + backward, torch backend on the CPU, triton
on CUDA): the plain step against rule replay (top_k 1,024 with top_p 0.9; top_p 0.9 alone), min-p alone (0.05) and
kept-set replay (a `SamplingMask` of 1,024 ids per position, vLLM's CSR form), as ratios of time and peak extra
memory to the plain step of the same run.

    python -m benchmarks.sampling_replay                  # the size's TRL case (CPU: fp32, N 2,048, H 896, V 151,936)
    python -m benchmarks.sampling_replay --size smoke --rounds 1     # a quick check
    python -m benchmarks.sampling_replay --rows 1024      # the size's case at N 1,024 (a loaded CPU: half the time)

Cases run in interleaved rounds in one process after a warm-up each (the order reversed every other round), medians
of the wall time and of the process's CPU time (all threads; on a shared CPU it moves less than the wall time);
peak extra memory as the suites take it (CPU: a fresh process per case, VmHWM over VmRSS; CUDA: the allocator's
peak). Inputs: `benchmarks.cases.inputs` (logits ~ N(0, 1), so top-p 0.9 alone keeps most of the vocabulary and
top_k bounds the kept set); the kept sets are the 1,024 largest logits of each position. Floor: the plain step.
Targets (docs/sampling_replay.md): rule replay ≤ 1.3×, min-p and kept-set ≤ 1.1× the plain step's time, and no
extra [N, V] memory. `--out` writes JSON and its markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import grpo_kernels as gk
from benchmarks import cases
from benchmarks.peak_memory import peak_extra_bytes as measure_peak
from benchmarks.shapes import SIZES, TRL_CASES

KEPT = 1024  # ids per position of the kept-set case (prime-rl bounds its kept sets at 512)
CASES = {  # name -> the replay keywords of fused_linear_grpo_loss ("mask": the kept-set SamplingMask)
    "plain": {},
    "top_k_top_p": dict(top_k=KEPT, top_p=0.9),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.05),
    "kept_set": dict(sampling_mask="mask"),
}


def shape_of(size: str, rows: int | None = None):
    """The size's TRL case (the standard fused-lm_head case), or its first shape where it has none; N = `rows`
    when given."""
    shape = TRL_CASES.get(size) or SIZES[size][0]
    return shape if rows is None else dataclasses.replace(shape, N=rows)


def inputs(shape) -> dict:
    """`cases.inputs` plus the kept-set mask: each position's KEPT largest logits, as a CSR `SamplingMask`."""
    data = cases.inputs(shape)
    hidden, weight = data["hidden"].flatten(0, 1), data["weight"]
    kept = min(KEPT, shape.V)
    ids = torch.cat([(h @ weight.T).topk(kept, dim=-1).indices for h in hidden.split(256)])  # [N, kept]
    offsets = torch.arange(0, ids.numel() + 1, kept, device=ids.device)  # [N + 1]
    data["mask_csr"] = gk.SamplingMask(ids.flatten().int(), offsets)
    return data


def step(case: str, shape, data: dict):
    """One timed call: forward + backward of the fused lm_head + GRPO loss with `case`'s replay."""
    backend = "triton" if cases.device().type == "cuda" else "torch"
    replay = {k: (data["mask_csr"] if v == "mask" else v) for k, v in CASES[case].items()}
    options = shape.loss_options()
    args = [data[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]

    def run() -> None:
        hidden = data["hidden"].requires_grad_()
        weight = data["weight"].requires_grad_()
        loss = gk.fused_linear_grpo_loss(hidden, weight, *args, with_entropy=True, backend=backend, **options, **replay)
        loss.loss.backward()
        hidden.grad = weight.grad = None
        if cases.device().type == "cuda":
            torch.cuda.synchronize()

    return run


def times(shape, data: dict, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall seconds and CPU seconds (this process's, all threads) per round of every case, interleaved (round -1: the
    warm-up). On a CPU shared with other work the CPU seconds move less than the wall time."""
    steps = {case: step(case, shape, data) for case in CASES}
    wall: dict[str, list[float]] = {case: [] for case in CASES}
    cpu: dict[str, list[float]] = {case: [] for case in CASES}
    for r in range(-1, rounds):
        for case in list(CASES) if r % 2 else list(CASES)[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[case]()
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
            if r >= 0:
                wall[case].append(seconds)
                cpu[case].append(cpu_seconds)
            print(f"{case} round {r}: {seconds:.3f} s, CPU {cpu_seconds:.3f} s", flush=True)
    return wall, cpu


def peak_extra_bytes(case: str, size: str, shape, data: dict) -> int:
    """Peak extra memory of one step: CUDA in this process, the CPU in a fresh one."""
    if cases.device().type == "cuda":
        return measure_peak(step(case, shape, data))
    command = [sys.executable, "-m", "benchmarks.sampling_replay", "--size", size, "--rows", str(shape.N)]
    command += ["--memory-of", case]
    return int(subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()[-1])


def summary(result: dict) -> str:
    """The ratio table: each case's median time and peak extra memory, and both over the plain step's."""
    plain = result["cases"]["plain"]
    lines = [
        f"{result['shape']} on {result['device']}, torch {result['torch']}, {result['rounds']} interleaved rounds",
        "",
        "| case | median time | × plain | median CPU time | × plain | peak extra memory | × plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, r in result["cases"].items():
        lines.append(
            f"| {case} | {r['median_s']:.3f} s | {r['median_s'] / plain['median_s']:.2f}× | {r['median_cpu_s']:.3f} s "
            f"| {r['median_cpu_s'] / plain['median_cpu_s']:.2f}× | {r['peak_extra_bytes'] / 2**20:,.0f} MiB | "
            f"{r['peak_extra_bytes'] / plain['peak_extra_bytes']:.2f}× |"
        )
    nv = result["N"] * result["V"] * 4
    lines += ["", f"One [N, V] float32 buffer: {nv / 2**20:,.0f} MiB."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, help="N instead of the size's (its other dimensions kept)")
    parser.add_argument("--out", type=Path, help="JSON path (its markdown beside it)")
    parser.add_argument("--memory-of", choices=sorted(CASES), help=argparse.SUPPRESS)  # a fresh process's case
    args = parser.parse_args(argv)
    shape = shape_of(args.size, args.rows)
    data = inputs(shape)
    if args.memory_of:
        print(measure_peak(step(args.memory_of, shape, data)))
        return {}
    device = torch.cuda.get_device_name() if cases.device().type == "cuda" else "cpu"
    result = dict(shape=shape.name, N=shape.N, V=shape.V, device=device, torch=torch.__version__, rounds=args.rounds)
    wall, cpu = times(shape, data, args.rounds)
    result["cases"] = {
        case: dict(
            replay=dict(CASES[case]),
            seconds=wall[case],
            median_s=statistics.median(wall[case]),
            cpu_seconds=cpu[case],
            median_cpu_s=statistics.median(cpu[case]),
            peak_extra_bytes=peak_extra_bytes(case, args.size, shape, data),
        )
        for case in CASES
    }
    text = summary(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()

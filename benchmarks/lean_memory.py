"""The fused lm_head + loss in its two memory modes, memory="fast" (row chunks) and memory="lean" (2-D tiles, the
vocabulary-major backward): peak extra memory and time of one forward + backward, against the floor.

    python -m benchmarks.lean_memory                       # CPU: fp32, B·T = 2,048 (78% kept), H = 896, V = 151,936
    python -m benchmarks.lean_memory --device cuda         # GPU: bf16, B·T = 8,192, H = 4,096, V = 151,936
    python -m benchmarks.lean_memory --smoke               # tiny shapes, a correctness run
    python -m benchmarks.lean_memory --dtype bfloat16      # the CPU shape in bf16

Memory floor: the gradients themselves, dW [V, H] + dH [B·T, H] in the input dtype. Time floor (printed beside): the
bare lm_head GEMMs of the kept rows (logits, dH, dW) in the input dtype. CPU: each mode's peak extra RSS (VmHWM after
the step minus VmRSS before it, the peak reset in between) in a fresh process, then the modes timed in interleaved
rounds in one process (the order reversed every other round), medians (and the median of each round's lean / fast
ratio, which load on a shared machine moves less). CUDA: max_memory_allocated above the inputs (after a warm-up
step), wall times with the device synchronised, the same interleaving. Loss: dapo, epsilon_high 0.28, beta 0.04 (a
token-level loss: the fast mode's 3-GEMM route). `--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.peak_memory import peak_extra_bytes as measure_peak

SHAPES = {
    "cpu": dict(B=8, T=256, H=896, V=151_936, dtype="float32"),
    "cuda": dict(B=32, T=256, H=4096, V=151_936, dtype="bfloat16"),
    "smoke": dict(B=2, T=64, H=32, V=3001, dtype="float32"),
}
KEEP = 0.78  # the fraction of tokens the mask keeps
MODES = ("fast", "lean")


def inputs(shape: dict, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    B, T, H, V = shape["B"], shape["T"], shape["H"], shape["V"]
    dtype = getattr(torch, shape["dtype"])
    data = dict(
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(V, H, generator=g) / H**0.5,
        targets=torch.randint(0, V, (B, T), generator=g),
        mask=torch.rand(B, T, generator=g) < KEEP,
        advantages=torch.randn(B, generator=g),
        old_logp=torch.randn(B, T, generator=g) - 12,
    )
    data["ref_logp"] = data["old_logp"] + 0.1
    data = {k: v.to(device) for k, v in data.items()}
    for name in ("hidden", "weight"):
        data[name] = data[name].to(dtype).requires_grad_()
    return data


def step(mode: str, data: dict) -> None:
    """One forward + backward; the gradients are dropped before the next one."""
    import grpo_kernels as gk

    for name in ("hidden", "weight"):
        data[name].grad = None
    args = [data[k] for k in ("hidden", "weight", "targets", "advantages", "old_logp", "ref_logp", "mask")]
    out = gk.fused_linear_grpo_loss(*args, memory=mode, loss_type="dapo", epsilon_high=0.28, beta=0.04)
    out.loss.backward()


def gemms(data: dict) -> None:
    """The bare lm_head GEMMs of the kept rows: logits, dH, dW."""
    with torch.no_grad():
        h = data["hidden"][data["mask"]]  # [M, H]
        w = data["weight"]
        z = h @ w.T  # [M, V]
        z @ w  # [M, H]
        z.T @ h  # [V, H]


def floor_bytes(data: dict) -> int:
    return sum(data[n].numel() * data[n].element_size() for n in ("hidden", "weight"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra_bytes(mode: str, data: dict, device: torch.device, shape_name: str, dtype: str) -> int:
    """The step's peak extra memory: in a fresh process on CPU, in this one on CUDA."""
    if device.type == "cuda":
        step(mode, data)  # warm-up: kernels compiled, allocator primed
        for name in ("hidden", "weight"):
            data[name].grad = None
        return measure_peak(lambda: step(mode, data), device)
    cmd = [sys.executable, "-m", "benchmarks.lean_memory", "--shape", shape_name, "--dtype", dtype, "--memory-of", mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def _child(mode: str, shape: dict) -> None:
    data = inputs(shape, torch.device("cpu"))
    print(measure_peak(lambda: step(mode, data), torch.device("cpu")))


def times(data: dict, device: torch.device, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each mode and of the bare GEMMs, in interleaved rounds after one warm-up round."""
    runs = {**{m: (lambda m=m: step(m, data)) for m in MODES}, "gemms": lambda: gemms(data)}
    out: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(-1, rounds):
        for name in list(runs) if r % 2 else list(runs)[::-1]:
            _sync(device)
            start = time.perf_counter()
            runs[name]()
            _sync(device)
            seconds = time.perf_counter() - start
            if r >= 0:
                out[name].append(seconds)
            print(f"round {r} {name}: {seconds:.3f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a correctness run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the shape's")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--memory-of", choices=MODES, help=argparse.SUPPRESS)  # the fresh process of one CPU case
    args = parser.parse_args(argv)
    shape_name = args.shape or ("smoke" if args.smoke else args.device)
    shape = dict(SHAPES[shape_name], dtype=args.dtype or SHAPES[shape_name]["dtype"])
    if args.memory_of:
        _child(args.memory_of, shape)
        return {}
    device = torch.device(args.device)
    data = inputs(shape, device)
    floor = floor_bytes(data)
    result = dict(shape=shape, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, floor_bytes=floor, kept=int(data["mask"].sum()))  # fmt: skip
    for mode in MODES:
        result[f"{mode}_peak_extra_bytes"] = peak_extra_bytes(mode, data, device, shape_name, shape["dtype"])
    seconds = times(data, device, args.rounds)
    for name, values in seconds.items():
        result[f"{name}_seconds"] = values
        result[f"{name}_median_s"] = statistics.median(values)
    result["lean_over_fast_paired_median"] = statistics.median(
        a / b for a, b in zip(seconds["lean"], seconds["fast"], strict=True)
    )
    text = summary(result, args.rounds)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
    return result


def summary(result: dict, rounds: int) -> str:
    """The numbers as markdown: one table row per mode, against the floors."""
    shape, floor, gemm = result["shape"], result["floor_bytes"], result["gemms_median_s"]
    lines = [
        f"{result['device']}, torch {result['torch']}, {shape['dtype']}, B·T = {shape['B'] * shape['T']:,} "
        f"({result['kept']:,} kept), H = {shape['H']:,}, V = {shape['V']:,}; median of {rounds} interleaved rounds",
        "",
        "| memory= | peak extra memory (× dW + dH) | time (× fast, × the bare lm_head GEMMs) |",
        "|---|---|---|",
    ]
    for mode in MODES:
        peak, median = result[f"{mode}_peak_extra_bytes"], result[f"{mode}_median_s"]
        lines.append(
            f"| {mode} | {peak / 2**20:,.0f} MiB ({peak / floor:.2f}×) | {median:.3g} s "
            f"({median / result['fast_median_s']:.2f}×, {median / gemm:.2f}×) |"
        )
    lines += [
        "",
        f"Floors: dW + dH {floor / 2**20:,.0f} MiB; bare lm_head GEMMs {gemm:.3g} s. lean / fast, the median of the "
        f"rounds' ratios: {result['lean_over_fast_paired_median']:.2f}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

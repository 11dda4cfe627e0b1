"""Providers measured side by side on one case, in interleaved rounds in one process: each round runs every provider
once (the order reversed every other round), so that load on the machine falls on all of them alike. Median of the
rounds; the floor and the peak extra memory as the suite takes them (CPU: a fresh process per case). Writes JSON in
pytest-benchmark's layout (`python -m benchmarks.report` reads it) and its markdown beside it, with the ratio
tables against TRL.

    python -m benchmarks.interleaved                       # ours vs TRL 1.16 on the size's TRL case
    python -m benchmarks.interleaved --size smoke --rounds 1 --out /tmp/smoke.json    # a quick check

Defaults: the fused lm_head + loss and the log-prob pass, forward + backward, ours and TRL, 3 rounds, the case
`shapes.TRL_CASES[size]` (size: gpu with CUDA, else cpu; cpu is fp32, N = 2,048, H = 896, V = 151,936, dapo, beta
0.04), JSON into benchmarks/results/<device>/<date>-trl.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import cases, report
from benchmarks.shapes import SIZES, TRL_CASES


def measure(bench: str, mode: str, shape, providers: list[str], rounds: int, data: dict, floors: dict) -> list[dict]:
    """One pytest-benchmark-shaped record per provider: interleaved rounds after one warm-up each. `floors` caches
    the floor by (logits-level or fused, mode): the two fused benches share their GEMMs."""
    steps = {p: cases.step(bench, p, shape, mode, data) for p in providers}
    times: dict[str, list[float]] = {p: [] for p in providers}
    for r in range(-1, rounds):  # round -1 is the warm-up
        for provider in providers if r % 2 else providers[::-1]:
            cases.restore(data)
            start = time.perf_counter()
            steps[provider]()
            if r >= 0:
                times[provider].append(time.perf_counter() - start)
            print(f"{bench} {mode} {provider} round {r}: {time.perf_counter() - start:.3f} s", flush=True)
    key = (bench == "grpo_loss", mode)
    floor = floors[key] = floors.get(key) or cases.floor_seconds(bench, mode, data)
    records = []
    for provider in providers:
        median = statistics.median(times[provider])
        info = _info(bench, provider, shape, mode, rounds)
        info.update(median_s=median, tokens_per_s=shape.N / median, floor_s=floor)
        info["peak_extra_bytes"] = cases.peak_extra_bytes(bench, provider, shape, mode, data)
        print(
            f"{bench} {mode} {provider}: median {median:.3f} s, peak extra {info['peak_extra_bytes'] / 2**20:,.0f} MiB"
        )
        stats = dict(median=median, min=min(times[provider]), max=max(times[provider]), rounds=rounds)
        records.append(dict(name=f"{bench}[{shape.name}-{provider}-{mode}]", extra_info=info, stats=stats))
    return records


def _info(bench: str, provider: str, shape, mode: str, rounds: int) -> dict:
    return dict(cases.case_info(bench, provider, shape, mode, shape.size), interleaved_rounds=rounds)


def main(argv: list[str] | None = None) -> Path:
    size = "gpu" if torch.cuda.is_available() else "cpu"
    ours = ["torch"] + (["triton"] if cases.device().type == "cuda" else [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=size)
    parser.add_argument("--shape", help="a shape name of the size (default: the size's TRL case)")
    parser.add_argument("--benches", nargs="+", default=["fused_linear", "token_logprobs"], choices=cases.BENCHES)
    parser.add_argument("--providers", nargs="+", default=[*ours, "trl"])
    parser.add_argument("--modes", nargs="+", default=["fwd_bwd"], choices=cases.MODES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/<device>/<date>-trl.json)")
    args = parser.parse_args(argv)
    shape = next(s for s in SIZES[args.size] if s.name == args.shape) if args.shape else TRL_CASES[args.size]
    data = cases.inputs(shape)
    records, floors = [], {}
    for bench in args.benches:
        providers = []
        for provider in args.providers:
            reason = cases.skip_reason(bench, provider) or _not_in(bench, provider)
            if reason:
                print(f"{bench} {provider}: skipped: {reason}", file=sys.stderr)
            else:
                providers.append(provider)
        for mode in args.modes:
            records += measure(bench, mode, shape, providers, args.rounds, data, floors)
    device = records[0]["extra_info"]["device"].replace(" ", "_") if records else "unknown"
    out = args.out or report.RESULTS / device / f"{datetime.date.today()}-trl.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(datetime=datetime.datetime.now().isoformat(), benchmarks=records), indent=1))
    rows = report.load(str(out))
    out.with_suffix(".md").write_text(report.markdown(rows))
    print(out, out.with_suffix(".md"), sep="\n")
    return out


def _not_in(bench: str, provider: str) -> str | None:
    if provider not in cases.providers(bench):
        return f"not a provider of {bench} ({cases.providers(bench)})"
    return None


if __name__ == "__main__":
    main()

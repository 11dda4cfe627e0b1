"""The fused lm_head's CPU tiles, measured: our passes at several tiles beside TRL 1.16's fused head, in interleaved
rounds in one process (each round runs every configuration once, the order reversed every other round, so that the
load of a shared machine falls on all of them alike), forward + backward of the GRPO loss step and of the log-prob
+ entropy pass. A tile is `fast:<rows>` (rows of tokens over the whole vocabulary, `chunk_size`; 3 GEMMs for the
token-level loss) or `lean:<rows>x<columns>` (`memory="lean"`, `tile=(rows, columns)`; 4 GEMMs); `default` is what
the fused head picks itself. The noise is each configuration's spread over its rounds (max / min − 1).

    python -m benchmarks.cpu_tiles                              # N 2,048, H 896, V 151,936, fp32, dapo, 2 rounds
    python -m benchmarks.cpu_tiles --n 64 --v 4096 --h 64 --rounds 1 --tiles default fast:32 lean:32x1024 --out x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import grpo_kernels as gk
from benchmarks import baselines, cases
from benchmarks.shapes import Shape

DEFAULT_TILES = ["default", "fast:256", "fast:1024", "fast:2048", "lean:1024x32768", "lean:2048x32768"]
BENCHES = ("fused_linear", "token_logprobs")


def tile_arguments(tile: str) -> dict:
    """The fused head's keywords for a tile name (module docstring)."""
    if tile == "default":
        return {}
    kind, _, size = tile.partition(":")
    if kind == "fast" and size.isdigit():
        return dict(memory="fast", chunk_size=int(size))
    rows, _, columns = size.partition("x")
    if kind == "lean" and rows.isdigit() and columns.isdigit():
        return dict(memory="lean", tile=(int(rows), int(columns)))
    raise ValueError(f"a tile must be default, fast:<rows> or lean:<rows>x<columns>, got {tile!r}")


def call(bench: str, config: str, shape: Shape, data: dict):
    """Forward + backward of `bench` by `config` ("trl" or a tile) on `data`."""
    options = shape.loss_options()
    args = [data[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]

    def run() -> None:
        hidden, weight = data["hidden"].requires_grad_(True), data["weight"].requires_grad_(True)
        if bench == "token_logprobs" and config == "trl":
            out = baselines.trl_logprobs(hidden, weight, data["targets"], data["mask"])[0].sum()
        elif bench == "token_logprobs":
            fused = dict(mask=data["mask"], with_entropy=True, backend="torch", **tile_arguments(config))
            out = gk.fused_linear_token_logprobs(hidden, weight, data["targets"], **fused)[0].sum()
        elif config == "trl":
            out = baselines.trl_loss(hidden, weight, *args, **options)
        else:
            keywords = dict(with_entropy=True, backend="torch", **tile_arguments(config), **options)
            out = gk.fused_linear_grpo_loss(hidden, weight, *args, **keywords).loss
        out.backward()
        hidden.grad = weight.grad = None

    return run


def sweep(shape: Shape, configs: list[str], rounds: int) -> list[dict]:
    data = cases.inputs(shape)
    records = []
    for bench in BENCHES:
        runs = {config: call(bench, config, shape, data) for config in configs}
        times: dict[str, list[float]] = {config: [] for config in configs}
        for r in range(-1, rounds):  # round -1 warms up
            for config in configs if r % 2 else configs[::-1]:
                start = time.perf_counter()
                runs[config]()
                seconds = time.perf_counter() - start
                print(f"{bench} {config} round {r}: {seconds:.2f} s", flush=True)
                if r >= 0:
                    times[config].append(seconds)
        trl = statistics.median(times["trl"]) if "trl" in times else None
        for config, seconds in times.items():
            median = statistics.median(seconds)
            records.append(
                dict(
                    bench=bench,
                    config=config,
                    seconds=seconds,
                    median_s=median,
                    spread=max(seconds) / min(seconds) - 1,
                    vs_trl=None if trl is None else median / trl,
                )
            )
    return records


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_tiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048, help="tokens")
    parser.add_argument("--v", type=int, default=151936, help="vocabulary")
    parser.add_argument("--h", type=int, default=896, help="hidden size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiles", nargs="+", default=DEFAULT_TILES)
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/cpu/<date>-tiles.json)")
    args = parser.parse_args(argv)
    for tile in args.tiles:
        try:
            tile_arguments(tile)  # a bad tile name stops here, before any work
        except ValueError as error:
            parser.error(str(error))
    shape = Shape(args.n, args.v, args.h, torch.float32)
    records = sweep(shape, ["trl", *args.tiles], args.rounds)
    out = args.out or Path("benchmarks/results/cpu") / f"{datetime.date.today()}-tiles.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = dict(processor=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    meta = dict(datetime=datetime.datetime.now().isoformat(), shape=shape.name, rounds=args.rounds, machine=machine)
    out.write_text(json.dumps(dict(meta, records=records), indent=1))
    for r in records:
        ratio = "" if r["vs_trl"] is None else f"{r['vs_trl']:.2f}× TRL"
        print(f"{r['bench']:>15} {r['config']:>16}: {r['median_s']:7.2f} s  spread {r['spread']:5.1%}  {ratio}")
    print(out)
    return out


if __name__ == "__main__":
    main()

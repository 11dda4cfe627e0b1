"""The performance numbers of README.md and docs/benchmarks.md, generated from the committed result files under
benchmarks/results/, so that each claim has one number and one source.

    python -m benchmarks.documented_numbers --write       # rewrites every passage below from its files (and prints)

Each passage sits between a `BEGIN` line naming it and an `END` line in its page; `tests/test_result_numbers.py` fails
while a page's passage differs from what its files give. When a newer run of a case disagrees with an older one, the
passage names the current one and says why (here: the CPU loss step against TRL, measured on 2026-11-23 and again on
2026-11-28).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
H100 = RESULTS / "gpu" / "2026-11-26-headline.json"
TRL_CPU = RESULTS / "cpu" / "2026-11-23-trl.json"  # interleaved: ours, TRL, eager; time and peak memory
TRL_STEP_CPU = RESULTS / "cpu" / "2026-11-23-trl-step.json"  # GRPOTrainer.training_step, stock vs drop-in
TILES_CPU = RESULTS / "cpu" / "2026-11-28-tiles-n2048.json"  # the same loss step, rerun beside TRL
MIB = 2.0**20


@dataclass(frozen=True)
class Passage:
    name: str
    page: Path
    text: Callable[[], str]  # the passage as its files give it

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}: python -m benchmarks.documented_numbers --write -->"

    @property
    def end(self) -> str:
        return f"<!-- end of {self.name} -->"


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _pytest_benchmark(path: Path, bench: str, provider: str) -> dict:
    """Median, min and max seconds and peak extra MiB of `provider`'s forward + backward of `bench` in a
    pytest-benchmark JSON."""
    named = re.compile(rf"{bench}\[.*-{provider}(-fwd_bwd)?\]$")
    (case,) = [b for b in _load(path)["benchmarks"] if named.match(b["name"])]
    stats = case["stats"]
    return dict(
        median=stats["median"], low=stats["min"], high=stats["max"], mib=case["extra_info"]["peak_extra_bytes"] / MIB
    )


def _tiles(bench: str, config: str) -> dict:
    (record,) = [r for r in _load(TILES_CPU)["records"] if r["bench"] == bench and r["config"] == config]
    return record


def _times(ratio: float) -> str:
    return f"{ratio:.2f}×"


def h100_headline() -> str:
    """The README's H100 paragraph and table."""
    run = _load(H100)
    case, rows = run["case"], run["rows"]
    floor = next(r["ms"] for r in rows if r["provider"] == "gemms")
    measured = [r for r in rows if r["provider"] != "gemms"]
    fastest, smallest = min(r["ms"] for r in measured), min(r["peak_extra_mib"] for r in measured)
    lines = [
        f"**H100** (one independent run, {run['date']}; torch {run['torch'].replace('.0+', '+')}, triton "
        f"{run['triton'].removesuffix('.0')}, H100 80GB; {case['dtype']}, H = {case['H']:,}, V = {case['V']:,}, "
        f"N = {case['N']:,} tokens, dapo + KL + entropy, forward + backward; `python -m benchmarks.headline`; file "
        f"`{H100.relative_to(ROOT)}`):",
        "",
        "| fused lm_head + GRPO loss | time | × the 3 bare GEMMs | peak extra memory |",
        "|---|---|---|---|",
    ]
    for r in measured:
        ratio = r["ms"] / floor
        time = f"{r['ms']:.3g} ms"
        memory = f"{r['peak_extra_mib']:,} MiB"
        lines.append(
            f"| {r['label']} | {f'**{time}**' if r['ms'] == fastest else time} | "
            f"{f'{ratio:.2f}' if ratio < 10 else f'{ratio:.1f}'} | "
            f"{f'**{memory}**' if r['peak_extra_mib'] == smallest else memory} |"
        )
    return "\n".join(lines)


def _cpu_numbers() -> dict:
    ours, trl = _pytest_benchmark(TRL_CPU, "fused_linear", "torch"), _pytest_benchmark(TRL_CPU, "fused_linear", "trl")
    eager = _pytest_benchmark(TRL_CPU, "fused_linear", "naive")
    return dict(
        ours=ours,
        trl=trl,
        eager=eager,
        now_ours=_tiles("fused_linear", "default"),
        now_trl=_tiles("fused_linear", "trl"),
    )


def cpu_headline() -> str:
    """The README's CPU sentence: the time of the current run (2026-11-28), the memory of the 2026-11-23 run."""
    n = _cpu_numbers()
    ours, trl, eager, now_ours, now_trl = n["ours"], n["trl"], n["eager"], n["now_ours"], n["now_trl"]
    return (
        f"**CPU** (a shared 2-core machine, torch 2.13, fp32, N = 2,048, H = 896, V = 151,936, dapo, forward + "
        f"backward): ours {now_ours['median_s']:.2f} s against TRL 1.16's {now_trl['median_s']:.1f} s "
        f"(**{_times(now_ours['vs_trl'])} the time**; 2026-11-28, `python -m benchmarks.cpu_tiles --n 2048`) and "
        f"{ours['mib']:,.0f} MiB of peak extra memory against TRL's {trl['mib']:,.0f} MiB "
        f"(**{_times(ours['mib'] / trl['mib'])}**; eager {eager['mib']:,.0f} MiB; 2026-11-23, `python -m "
        f"benchmarks.interleaved --providers torch trl naive`). Loss equal to TRL's; why the 2026-11-23 run's "
        f"{_times(ours['median'] / trl['median'])} time is superseded, and more: "
        f"[docs/benchmarks.md](docs/benchmarks.md#cpu)."
    )


def cpu_against_trl() -> str:
    """docs/benchmarks.md's table against TRL and eager (2026-11-23) and which of its times is current."""
    n = _cpu_numbers()
    ours, trl, now_ours, now_trl = n["ours"], n["trl"], n["now_ours"], n["now_trl"]
    rows = [
        '| case | TRL 1.16: time, peak extra memory | ours: time, memory (× TRL) | eager ("naive") |',
        "|---|---|---|---|",
    ]
    for bench, label in (("fused_linear", "fused lm_head + GRPO loss"), ("token_logprobs", "log-prob + entropy pass")):
        o, t, e = (_pytest_benchmark(TRL_CPU, bench, p) for p in ("torch", "trl", "naive"))
        rows.append(
            f"| {label} | {t['median']:.1f} s, {t['mib']:,.0f} MiB | {o['median']:.3g} s, {o['mib']:,.0f} MiB "
            f"(**{o['median'] / t['median']:.2f}×, {o['mib'] / t['mib']:.2f}×**) | {e['median']:.1f} s, "
            f"{e['mib']:,.0f} MiB |"
        )
    (drop_in, stock) = (_pytest_benchmark(TRL_STEP_CPU, "trl_step", p) for p in ("drop_in", "trl"))
    rows.append(
        f"| one `GRPOTrainer.training_step`: stock TRL vs the drop-in (2-layer Qwen2, H = 896, V = 151,936, 8 × 256 "
        f"completion tokens) | {stock['median']:.1f} s, {stock['mib']:,.0f} MiB | {drop_in['median']:.3g} s, "
        f"{drop_in['mib']:,.0f} MiB (**{drop_in['median'] / stock['median']:.2f}×, "
        f"{drop_in['mib'] / stock['mib']:.2f}×**) | — |"
    )
    rounds = ", ".join(f"{s:.1f}" for s in now_trl["seconds"])
    then_pass = _pytest_benchmark(TRL_CPU, "token_logprobs", "torch")["median"]
    then_pass /= _pytest_benchmark(TRL_CPU, "token_logprobs", "trl")["median"]
    current = (
        f"Which times are current: those of 2026-11-28 (`{TILES_CPU.name}`, the tiles table below), the loss step "
        f"{_times(now_ours['vs_trl'])} TRL's time (not {_times(ours['median'] / trl['median'])}) and the log-prob "
        f"pass {_times(_tiles('token_logprobs', 'default')['vs_trl'])} (not {_times(then_pass)}). Both runs time the "
        f"same functions on the same shape, and ours took the same in both ({ours['median']:.2f} s, "
        f"{now_ours['median_s']:.2f} s for the loss step); TRL's three rounds of 2026-11-23 spread from "
        f"{trl['low']:.1f} to {trl['high']:.1f} s (other work on the machine; even its fastest is above both of "
        f"2026-11-28's), while on 2026-11-28 its rounds took {rounds} s, {now_trl['spread']:.0%} apart. The memory "
        f"ratios, measured in a fresh process per case, do not depend on the load and stand."
    )
    return "\n".join(rows) + "\n\n" + current


PASSAGES = (
    Passage("the H100 headline", ROOT / "README.md", h100_headline),
    Passage("the CPU headline", ROOT / "README.md", cpu_headline),
    Passage("the CPU table against TRL", ROOT / "docs" / "benchmarks.md", cpu_against_trl),
)


def documented(passage: Passage) -> str:
    """The passage as its page holds it now."""
    pattern = re.escape(passage.begin) + r"\n(.*?)\n" + re.escape(passage.end)
    found = re.search(pattern, passage.page.read_text(encoding="utf-8"), re.S)
    if found is None:
        raise ValueError(f"{passage.page} has no passage between {passage.begin!r} and {passage.end!r}")
    return found.group(1)


def generated(passage: Passage) -> str:
    """The passage as its files give it, in the pages' 120-character lines (tables unwrapped)."""
    from benchmarks.documented_numbers import wrapped

    blocks = passage.text().split("\n\n")
    return "\n\n".join(block if block.startswith("|") else wrapped(block) for block in blocks)


def write_all() -> None:
    """Every passage rewritten from its files."""
    for passage in PASSAGES:
        text = passage.page.read_text(encoding="utf-8")
        old = f"{passage.begin}\n{documented(passage)}\n{passage.end}"
        passage.page.write_text(text.replace(old, f"{passage.begin}\n{generated(passage)}\n{passage.end}"), "utf-8")

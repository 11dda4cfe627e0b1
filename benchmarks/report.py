"""`python -m benchmarks.report out.json`: markdown tables (ratios against the eager baseline of the same run, and
against TRL 1.16 where it ran) and PNG plots (time against vocabulary size and token count, a line per provider,
where a run has more than one shape) into benchmarks/results/<device>/."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(path: str) -> list[dict]:
    """One row per case: its extra_info plus the median time."""
    data = json.loads(Path(path).read_text())
    return [{**b["extra_info"], "median_s": b["stats"]["median"]} for b in data["benchmarks"] if b.get("stats")]


def _cell(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    """A markdown section per (bench, shape, mode): time, tokens/s, memory and their ratios to `naive`."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row["bench"], row["shape"], row["mode"])].append(row)
    out = []
    for (bench, shape, mode), group in sorted(groups.items()):
        base = next((r for r in group if r["provider"] == "naive"), None)
        out += [
            f"### {bench} · {shape} · {mode}",
            "",
            "| provider | median | tokens/s | × naive time | peak extra | × naive memory | floor / time |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(group, key=lambda r: r["median_s"]):
            mem = r.get("peak_extra_bytes")
            t_ratio = r["median_s"] / base["median_s"] if base else None
            m_ratio = mem / base["peak_extra_bytes"] if base and mem and base.get("peak_extra_bytes") else None
            floor = r["floor_s"] / r["median_s"] if r.get("floor_s") else None
            out.append(
                f"| {r['provider']} | {r['median_s'] * 1e3:.1f} ms | {r['N'] / r['median_s']:,.0f} | "
                f"{_cell(t_ratio, '.2f')} | {_cell(mem and mem / 2**20, ',.0f')} MiB | {_cell(m_ratio, '.2f')} "
                f"| {_cell(floor, '.0%')} |"
            )
        out.append("")
    return "\n".join(out)


LABELS = {
    "grpo_loss": "logits-level loss",
    "fused_linear": "fused lm_head + loss",
    "token_logprobs": "log-prob + entropy pass",
    "trl_step": "GRPOTrainer.training_step",
    "fwd": "fwd",
    "fwd_bwd": "fwd + bwd",
}


def trl_table(rows: list[dict]) -> str:
    """One row per (bench, shape, mode) that TRL ran: TRL's time and peak extra memory, and every other provider's
    time and memory as ratios to TRL's (the README's form: "0.39×, 0.30×"). Empty when TRL did not run."""
    groups = defaultdict(dict)
    for row in rows:
        groups[(row["bench"], row["shape"], row["mode"])][row["provider"]] = row
    groups = {key: group for key, group in sorted(groups.items()) if "trl" in group}
    if not groups:
        return ""
    others = sorted({p for group in groups.values() for p in group if p != "trl"}, key=lambda p: (p == "naive", p))
    out = [
        "## Against TRL 1.16 (ratios: time, peak extra memory)",
        "",
        f"| case | TRL: time, peak extra | {' | '.join(others)} |",
        f"|---|---|{'---|' * len(others)}",
    ]
    for (bench, shape, mode), group in groups.items():
        trl = group["trl"]
        cells = []
        for provider in others:
            r = group.get(provider)
            mem, base = (r or {}).get("peak_extra_bytes"), trl.get("peak_extra_bytes")
            m_ratio = mem / base if mem is not None and base else None
            memory = "—" if m_ratio is None else f"{m_ratio:.2f}×"
            cells.append("—" if r is None else f"{r['median_s'] / trl['median_s']:.2f}×, {memory}")
        mem = trl.get("peak_extra_bytes")
        memory = "—" if mem is None else f"{mem / 2**20:,.0f} MiB"
        out.append(
            f"| {LABELS.get(bench, bench)}, {LABELS.get(mode, mode)} · {shape} | {trl['median_s'] * 1e3:,.0f} ms, "
            f"{memory} | {' | '.join(cells)} |"
        )
    return "\n".join([*out, ""])


def markdown(rows: list[dict]) -> str:
    head = f"# Benchmarks on {rows[0]['device']} (torch {rows[0]['torch']})\n\n" if rows else ""
    trl = trl_table(rows)
    return head + (trl + "\n" if trl else "") + table(rows)


def plots(rows: list[dict], folder: Path) -> list[Path]:
    """Time against V (at the largest N) and against N (at the largest V), per bench and mode; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []
    for bench, mode in sorted({(r["bench"], r["mode"]) for r in rows}):
        subset = [r for r in rows if r["bench"] == bench and r["mode"] == mode and r["loss"] == "dapo"]
        if len({r["shape"] for r in subset}) < 2:  # nothing to plot against
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, axis, other in ((axes[0], "V", "N"), (axes[1], "N", "V")):
            fixed = max(r[other] for r in subset)
            for provider in sorted({r["provider"] for r in subset}):
                points = sorted(
                    (r[axis], r["median_s"]) for r in subset if r["provider"] == provider and r[other] == fixed
                )
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=provider)
            ax.set(xlabel=axis, ylabel="median time (s)", title=f"{bench} {mode}, {other} = {fixed}", yscale="log")
            ax.legend()
        fig.tight_layout()
        path = folder / f"{bench}-{mode}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(path: str) -> None:
    rows = load(path)
    device = rows[0]["device"].replace(" ", "_") if rows else "unknown"
    folder = RESULTS / device
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / (Path(path).stem + ".md")
    report.write_text(markdown(rows))
    for written in [report, *plots(rows, folder)]:
        print(written)


if __name__ == "__main__":
    main(sys.argv[1])

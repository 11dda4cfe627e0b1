"""The reward curves of several runs as one SVG line chart, written by hand so that it needs no plotting package."""

from __future__ import annotations

from html import escape
from pathlib import Path

from grpo_kernels.compare.report import smooth
from grpo_kernels.trainer import atomic_write

WIDTH, HEIGHT = 760, 420
LEFT, RIGHT, TOP, BOTTOM = 60, 170, 30, 50  # margins: y labels, legend, title, x labels
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
DASHES = ("", "6,3", "2,2")  # after the ten colours, the dash pattern tells curves apart


def reward_plot(curves: dict[str, list[tuple[int, float]]], path: Path, *, title: str, window: int) -> None:
    """Write `path`: one polyline per run of its reward against the step, smoothed over `window` steps; y from 0 to
    the larger of 1 and the highest value."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    points = [p for curve in curves.values() for p in curve]
    x_max = max((s for s, _ in points), default=1) or 1
    y_max = max(1.0, max((r for _, r in points), default=1.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def xy(step: float, value: float) -> str:
        return f"{LEFT + plot_w * step / x_max:.1f},{TOP + plot_h * (1 - max(value, 0.0) / y_max):.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT}" y="{TOP - 10}" font-size="14">{escape(title)}</text>',
    ]
    for k in range(6):  # horizontal grid and y labels
        value = y_max * k / 5
        y = TOP + plot_h * (1 - k / 5)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.1f}</text>')
    for k in range(6):  # x labels
        step = x_max * k / 5
        x = LEFT + plot_w * k / 5
        parts.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{step:.0f}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">step</text>')
    parts.append(
        f'<text x="16" y="{TOP + plot_h / 2}" text-anchor="middle" transform="rotate(-90 16 {TOP + plot_h / 2})">'
        f"reward ({window}-step mean)</text>"
    )
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    for i, (name, curve) in enumerate(curves.items()):
        color, dash = COLORS[i % len(COLORS)], DASHES[(i // len(COLORS)) % len(DASHES)]
        style = f' stroke-dasharray="{dash}"' if dash else ""
        values = smooth([r for _, r in curve], window)
        line = " ".join(xy(s, v) for (s, _), v in zip(curve, values, strict=True))
        if line:
            parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.6"{style}/>')
        y = TOP + 10 + 18 * i
        x = LEFT + plot_w + 12
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{color}" stroke-width="2"{style}/>')
        parts.append(f'<text x="{x + 30}" y="{y + 4}">{escape(name)}</text>')
    parts.append("</svg>")
    atomic_write.write_text(path, "\n".join(parts) + "\n")

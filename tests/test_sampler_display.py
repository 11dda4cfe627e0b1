"""The sampler's metrics in the open: the progress line and the summary show the kept mass (truncated sampling) and
the sampler-sync guard's gap, readable at fp32's ~1e-7, and metrics.png gains a sampler panel when they exist."""

from __future__ import annotations

import struct

import pytest

from grpo_kernels.trainer.logging import MetricsLogger, number, plot_metrics, summary_table

GAP = "sampling/sampling_logp_difference/mean"


def _records(steps: int, truncated: bool) -> list[dict]:
    records = []
    for step in range(1, steps + 1):
        record = {"reward": 0.1 * step, "kl": 0.01, GAP: 7.7e-8 * step, "sampling/importance_sampling_ratio/mean": 1.0}
        if truncated:
            record["sampling/kept_mass"] = 0.9
        records.append(record)
    return records


def test_small_values_keep_their_digits():
    assert number(0.12345) == "0.123" and number(0.0) == "0.000" and number(7.7e-8) == "7.7e-08"


@pytest.mark.parametrize("truncated", [False, True])
def test_the_progress_line_and_the_summary_show_the_sampler(tmp_path, capsys, truncated):
    logger = MetricsLogger(tmp_path, total_steps=2, progress=True, progress_every=1, progress_seconds=0)
    for step, record in enumerate(_records(2, truncated), 1):
        logger.log(step, record)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("step 2/2 reward=0.200 kl=0.010")
    assert "sampler_gap=1.5e-07" in lines[-1] and ("kept_mass=0.900" in lines[-1]) == truncated
    table = summary_table(logger.history, wall_seconds=1.0, steps_run=2)
    assert "sampler_gap" in table and "1.5e-07" in table and "is_ratio" in table
    assert ("kept_mass" in table) == truncated
    logger.stop()


def _png_width(path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_the_plot_gains_a_sampler_panel_when_the_run_logged_one(tmp_path):
    pytest.importorskip("matplotlib")
    with_sampler = [{"step": s, **r} for s, r in enumerate(_records(3, truncated=True), 1)]
    without = [{k: v for k, v in r.items() if not k.startswith("sampling/")} for r in with_sampler]
    plot_metrics(with_sampler, tmp_path / "with.png")
    plot_metrics(without, tmp_path / "without.png")
    assert _png_width(tmp_path / "with.png") == 2000 and _png_width(tmp_path / "without.png") == 1600  # 5 panels, 4

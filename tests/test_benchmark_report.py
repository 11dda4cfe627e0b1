"""benchmarks.report turns pytest-benchmark JSON into ratio tables against the eager baseline of the same run."""

import json

from benchmarks import report


def test_table_ratios_against_naive(tmp_path):
    def case(provider, median, memory):
        info = dict(
            bench="grpo_loss",
            provider=provider,
            mode="fwd_bwd",
            shape="dapo-n512",
            N=512,
            V=32000,
            H=896,
            loss="dapo",
            device="cpu",
            torch="2.13",
            peak_extra_bytes=memory,
            floor_s=0.05,
        )
        return {"extra_info": info, "stats": {"median": median}}

    path = tmp_path / "out.json"
    path.write_text(json.dumps({"benchmarks": [case("naive", 0.4, 4 * 2**20), case("torch", 0.2, 2**20)]}))
    text = report.table(report.load(str(path)))
    assert "| torch | 200.0 ms | 2,560 | 0.50 | 1 MiB | 0.25 | 25% |" in text
    assert "| naive | 400.0 ms | 1,280 | 1.00 | 4 MiB | 1.00 | 12% |" in text

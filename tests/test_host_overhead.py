"""`python -m benchmarks.host_overhead` runs every public function forward and forward + backward, checks on and off,
and prints one row per function (numbers are measured by deliberate runs, never asserted)."""

import json

from benchmarks import host_overhead


def test_table_and_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    host_overhead.main(["--repeats", "1", "--warmup", "0", "--json", str(out)])
    table = capsys.readouterr().out
    for name in host_overhead.FUNCTIONS:
        assert f"| {name} |" in table
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(host_overhead.FUNCTIONS) * 2 * 2
    assert all(r["min_ms"] > 0 for r in rows)

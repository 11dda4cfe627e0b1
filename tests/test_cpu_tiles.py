"""benchmarks/cpu_tiles.py at a tiny size: every tile runs both passes beside TRL's fused head, and a bad tile name
is one error line."""

import json

import pytest

pytest.importorskip("trl.kernels.chunked_logprob")

from benchmarks import cpu_tiles  # noqa: E402


def test_sweep_records_every_tile_beside_trl(tmp_path, capsys):
    tiles = ["default", "fast:8", "lean:8x32"]
    out = cpu_tiles.main(
        ["--n", "16", "--v", "64", "--h", "8", "--rounds", "2", "--tiles", *tiles, "--out", str(tmp_path / "t.json")]
    )
    records = json.loads(out.read_text())["records"]
    assert {(r["bench"], r["config"]) for r in records} == {(b, c) for b in cpu_tiles.BENCHES for c in ["trl", *tiles]}
    assert all(len(r["seconds"]) == 2 and r["vs_trl"] > 0 for r in records)


@pytest.mark.parametrize("tile", ["fast:x", "lean:8", "wide:8"])
def test_bad_tile_is_one_error_line(tile, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cpu_tiles.main(["--tiles", tile])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("python -m benchmarks.cpu_tiles: error: a tile must be")
    )

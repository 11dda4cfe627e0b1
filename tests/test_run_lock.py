"""The run lock file is never written through: a symbolic link or a FIFO where `.run.lock` belongs is refused in
one error naming the file, and what a link points to is left as it was."""

import os

import pytest

from grpo_kernels.trainer import run_lock
from grpo_kernels.trainer.__main__ import main as train_main
from tests.test_run_dir import run_main


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path, capsys):
    run, target = tmp_path / "run", tmp_path / "outside.txt"
    run.mkdir()
    target.write_text("keep me", encoding="utf-8")
    (run / run_lock.LOCK_FILE).symlink_to(target)
    with pytest.raises(run_lock.UnsafeLockFile, match=r"\.run\.lock' is a symbolic link, not the run lock"):
        run_lock.claim(run)
    assert target.read_text(encoding="utf-8") == "keep me"
    assert run_lock.holder(run) is None
    status, _, err = run_main(train_main, ["--output-dir", str(run), "--steps", "1", "--no-plot"], capsys)
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and ".run.lock' is a symbolic" in err
    assert target.read_text(encoding="utf-8") == "keep me"


def test_a_fifo_lock_file_is_refused_naming_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / run_lock.LOCK_FILE)
    with pytest.raises(run_lock.UnsafeLockFile, match=rf"^'{run / run_lock.LOCK_FILE}' is a FIFO, not the run lock"):
        run_lock.claim(run)
    assert run_lock.holder(run) is None

"""`python -m grpo_kernels.compare` interrupted and resumed: SIGTERM during the second run stops it and writes the
table, JSON and plot of the finished run with the stopped one marked, in one line on stderr and no traceback;
`--resume --output-dir DIR` keeps the finished run and runs the rest. Preset names compare case-insensitively."""

import json
import os
import signal
import threading
import time

import pytest

from grpo_kernels.compare import CompareConfig
from grpo_kernels.compare.__main__ import main
from grpo_kernels.compare.runs import run_configs

TINY = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--num-generations", "2"]
TINY += ["--prompts-per-step", "2", "--device", "cpu"]


def test_preset_names_compare_case_insensitively(tmp_path):
    with pytest.raises(ValueError, match="presets must differ"):
        run_configs(CompareConfig(presets=("grpo", "GRPO"), output_dir=str(tmp_path)))
    configs = run_configs(CompareConfig(presets=("GRPO", "Dapo"), output_dir=str(tmp_path)))
    assert {p: c.output_dir for p, c in configs.items()} == {
        "grpo": str(tmp_path / "grpo"),
        "dapo": str(tmp_path / "dapo"),
    }


def one_line(capsys, argv: list[str], status: int) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == status and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_sigterm_keeps_the_finished_runs_and_resume_continues_the_rest(tmp_path, capsys):
    out = tmp_path / "cmp"
    default = signal.getsignal(signal.SIGTERM)

    def terminate_when_the_second_run_checkpoints() -> None:  # then grpo has finished and rloo is under way
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (out / "rloo" / "checkpoints" / "step_000004").is_dir():
                if signal.getsignal(signal.SIGTERM) is not default:  # compare's handler, never the test process's
                    os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.02)

    threading.Thread(target=terminate_when_the_second_run_checkpoints, daemon=True).start()
    args = ["--presets", "grpo,rloo", "--steps", "12", "--window", "1", "--output-dir", str(out)]
    err = one_line(capsys, [*args, "--checkpoint-every", "4", *TINY], status=130)
    assert err.startswith("interrupted: 1 of 2 runs finished, rloo interrupted") and "--resume" in err
    assert signal.getsignal(signal.SIGTERM) is default  # compare's handler is gone
    runs = json.loads((out / "compare.json").read_text())["runs"]
    assert [(r["preset"], r["error"]) for r in runs] == [("grpo", None), ("rloo", "interrupted")]
    assert "| rloo | interrupted |" in (out / "compare.md").read_text() and (out / "compare.svg").is_file()
    assert "Traceback" not in (out / "rloo.log").read_text()

    assert "drop --steps" in one_line(capsys, ["--resume", "--output-dir", str(out), "--steps", "5"], status=2)
    main(["--resume", "--output-dir", str(out)])
    assert "[1/2] grpo: finished before, kept" in capsys.readouterr().out
    assert "resuming from" in (out / "rloo.log").read_text()  # from its checkpoint, not from step 0
    rows = json.loads((out / "compare.json").read_text())["runs"]
    assert rows[0] == runs[0] and rows[1]["error"] is None and [s for s, _ in rows[1]["curve"]] == list(range(1, 13))

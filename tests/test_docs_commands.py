"""Every command in README.md and docs/*.md runs as written, or says why it cannot.

Each line of a ```bash block and each ```python block is a command. A line (or a Python block whose first line)
ending in `# needs: <reason>` asks for what CI lacks (a network, a GPU, vLLM, a long quiet run, or it is the test
command itself): it is skipped here, naming the reason. A line ending in `# error: <text>` must fail with one
`error: <text>...` line and exit status 2. Every other command runs, in order, in one fresh working directory per
file (a later line may use the run an earlier one made), with `GRPO_KERNELS_MAX_STEPS` capping every training run
at a few steps (the CLI and the examples honour it and print that they did).

`python -m <module>` and `python <file>.py` run in this process (no interpreter start-up per line); any other
line runs under bash. A `python -m grpo_kernels.compare` line that another file already ran as written is not run
again (a comparison starts a process per preset; it needs nothing from the lines before it).
"""

from __future__ import annotations

import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_STEPS = "1"  # GRPO_KERNELS_MAX_STEPS for the documented runs
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"#\s*(needs|error):\s*(.*?)\s*$")
SHELL = ("bash", "sh", "shell", "console")
REPEATABLE = ("python -m grpo_kernels.compare",)  # commands that need nothing from earlier lines
_already_run: set[str] = set()


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    kind: str  # "shell" or "python"
    text: str
    needs: str | None  # why CI cannot run it
    error: str | None  # the error line it must print


def commands(path: Path) -> list[Command]:
    """The commands of one Markdown file, in order."""
    text, found = path.read_text(encoding="utf-8"), []
    name = path.relative_to(ROOT).as_posix()
    for block in FENCE.finditer(text):
        language, body = block.group(1), block.group(2)
        first = text[: block.start(2)].count("\n") + 1
        if language == "python":
            mark = MARK.search(body.splitlines()[0]) if body.strip() else None
            needs = mark.group(2) if mark and mark.group(1) == "needs" else None
            found.append(Command(f"{name}:{first}", "python", body, needs, None))
        elif language in SHELL:
            for offset, line in enumerate(body.splitlines()):
                if line.strip() and not line.lstrip().startswith("#"):
                    mark = MARK.search(line)
                    kind = mark.group(1) if mark else None
                    found.append(
                        Command(
                            f"{name}:{first + offset}",
                            "shell",
                            line,
                            mark.group(2) if kind == "needs" else None,
                            mark.group(2) if kind == "error" else None,
                        )
                    )
    return found


def _run_shell(command: Command, cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    """(exit status, stderr) of one shell line: `python -m` / `python file.py` in this process, else bash."""
    words = shlex.split(command.text, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[:1] != ["python"] or any(w in ("|", ">", "<", "&&", ";") for w in words):
        done = subprocess.run(
            command.text, shell=True, executable="/bin/bash", cwd=cwd, capture_output=True, text=True, timeout=300
        )
        return done.returncode, done.stderr
    with monkeypatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        capsys.readouterr()
        status = 0
        try:
            if words[1] == "-m":
                patch.setattr(sys, "argv", [words[2], *words[3:]])
                runpy.run_module(words[2], run_name="__main__", alter_sys=True)
            else:
                patch.setattr(sys, "argv", [str(ROOT / words[1]), *words[2:]])
                runpy.run_path(str(ROOT / words[1]), run_name="__main__")
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return status, capsys.readouterr().err


def _runnable(path: Path) -> list[Command]:
    return [c for c in commands(path) if c.needs is None]


def run_commands(path: Path, tmp_path: Path, monkeypatch, capsys, skip: Callable[[list[str]], bool]) -> None:
    """The file's runnable commands, in order, in `tmp_path`, but those `skip` (of the command's words) says were run
    elsewhere."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # bash lines import this checkout
    threads = torch.get_num_threads()
    try:
        for command in _runnable(path):
            if command.kind == "python":
                exec(compile(command.text, command.where, "exec"), {"__name__": "__main__"})
                continue
            words = shlex.split(command.text, comments=True)
            if skip(words):
                continue
            status, stderr = _run_shell(command, tmp_path, monkeypatch, capsys)
            _already_run.add(shlex.join(words))
            if command.error is None:
                assert status == 0, f"{command.where}: `{command.text}` exited with {status}: {stderr[-2000:]}"
            else:
                expected = command.error.split("...")[0].strip()
                assert status == 2, f"{command.where}: `{command.text}` should fail with exit status 2, got {status}"
                assert f"error: {expected}" in stderr, f"{command.where}: expected `error: {expected}`, got {stderr}"
    finally:
        torch.set_num_threads(threads)  # the trainer sets its own


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documented_commands_run(path, tmp_path, monkeypatch, capsys):
    """The file's commands, in order, in a fresh directory; training runs capped at MAX_STEPS steps."""
    if not _runnable(path):
        pytest.skip(f"{path.name}: no command CI can run")
    monkeypatch.setenv("GRPO_KERNELS_MAX_STEPS", MAX_STEPS)
    run_commands(path, tmp_path, monkeypatch, capsys, _already_ran)


def _already_ran(words: list[str]) -> bool:
    return shlex.join(words).startswith(REPEATABLE) and shlex.join(words) in _already_run


MARKED = [c for path in FILES for c in commands(path) if c.needs is not None]


@pytest.mark.parametrize("command", MARKED, ids=lambda c: c.where)
def test_marked_commands_say_why_they_are_skipped(command):
    assert command.needs, f"{command.where}: `# needs:` without a reason"
    pytest.skip(f"{command.where} needs {command.needs}")


def test_the_extraction_sees_every_kind_of_command():
    readme = commands(ROOT / "README.md")
    assert {c.kind for c in readme} == {"shell", "python"}
    assert any("--preset dapo --output-dir runs/dapo --steps 100" in c.text and c.needs is None for c in readme)
    assert all(c.needs for c in readme if c.text.startswith(("pip ", "python -m pytest")))

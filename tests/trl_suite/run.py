"""Run TRL's GRPO test file twice, offline on the stand-ins, with stock `trl.GRPOTrainer` and with grpo-kernels'
drop-in, at the same time in two processes, and pair each test's outcomes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.trl_suite import plugin, source, standins

ROOT = Path(__file__).resolve().parents[2]  # the project: `tests.trl_suite.plugin` is imported from there


@dataclass(frozen=True)
class Outcome:
    outcome: str  # passed, failed, skipped, error, or "not run" (selected but absent from this TRL's file)
    message: str = ""
    seconds: float = 0.0  # the test's call (setup and teardown not counted)


@dataclass(frozen=True)
class SuiteResult:
    origin: str  # where TRL's test file came from
    outcomes: dict[str, dict[str, Outcome]]  # trainer ("stock", "drop-in") -> test id -> outcome
    fused_loss_calls: int  # how often the drop-in run computed its loss through the fused head
    supplied: tuple[str, ...] = ()  # names the test files import that the installed TRL lacks, supplied (source.py)

    def pairs(self) -> dict[str, tuple[Outcome, Outcome]]:
        """test id -> (stock's outcome, the drop-in's), over the tests either run reported."""
        stock, ours = self.outcomes["stock"], self.outcomes["drop-in"]
        missing = Outcome("not run")
        return {test: (stock.get(test, missing), ours.get(test, missing)) for test in sorted({*stock, *ours})}

    def differing(self) -> dict[str, tuple[Outcome, Outcome]]:
        return {test: pair for test, pair in self.pairs().items() if pair[0].outcome != pair[1].outcome}


def run_suite(selection: list[str] | None, timeout_s: float, pytest_args: tuple[str, ...] = ()) -> SuiteResult:
    """Both runs of TRL's test file (only the `selection`'s test ids when given). Raises source.Unavailable when
    TRL's test file cannot be had, RuntimeError when a run does not finish in `timeout_s` or reports nothing."""
    package_root, origin = source.fetch_tests()
    supplied = source.missing_names(package_root / source.PACKAGE)
    test_file = package_root / source.PACKAGE / "test_grpo_trainer.py"
    with tempfile.TemporaryDirectory(prefix="grpo_kernels_trl_suite_") as work:
        work = Path(work)
        hub_cache, datasets_root = standins.write_standins(work / "standins")
        (work / "pytest.ini").write_text("[pytest]\n")
        environment = {
            **os.environ,
            "HF_HUB_CACHE": str(hub_cache),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(work / "datasets_cache"),
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            plugin.DATASETS: str(datasets_root),
            plugin.SUPPLIED: json.dumps(supplied),
        }
        environment.pop("TRITON_INTERPRET", None)  # TRL's Triton kernels are for GPUs; under the interpreter they fail
        if selection is not None:
            environment[plugin.SELECTION] = json.dumps(selection)
        processes = {}
        try:
            for trainer in plugin.TRAINERS:
                processes[trainer] = _launch(trainer, test_file, package_root, work, environment, pytest_args)
            reports = {trainer: _report(trainer, process, work, timeout_s) for trainer, process in processes.items()}
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
    outcomes = {
        trainer: {test: Outcome(**entry) for test, entry in r["tests"].items()} for trainer, r in reports.items()
    }
    return SuiteResult(origin, outcomes, reports["drop-in"]["fused_loss_calls"], tuple(supplied))


def _launch(trainer: str, test_file: Path, package_root: Path, work: Path, environment: dict, pytest_args: tuple):
    """One pytest process on TRL's test file, its output in `<work>/<trainer>.log`."""
    command = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "tests.trl_suite.plugin"]
    command += ["-p", "no:cacheprovider", "-p", "no:xdist", "-c", str(work / "pytest.ini")]
    command += ["--rootdir", str(package_root), "-o", "addopts=", *pytest_args]
    environment = {**environment, plugin.TRAINER: trainer, plugin.OUTCOMES: str(work / f"{trainer}.json")}
    with (work / f"{trainer}.log").open("w") as log:
        return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)


def _report(trainer: str, process: subprocess.Popen, work: Path, timeout_s: float) -> dict:
    """The plugin's report of a run: {"tests": {test id: {outcome, message}}, "fused_loss_calls": n}."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {trainer} run of TRL's GRPO tests did not finish in {timeout_s:.0f} s") from None
    outcomes = work / f"{trainer}.json"
    report = json.loads(outcomes.read_text()) if outcomes.is_file() else {}
    if not report.get("tests"):
        tail = (work / f"{trainer}.log").read_text()[-3000:]
        raise RuntimeError(f"the {trainer} run of TRL's GRPO tests reported nothing:\n{tail}")
    return report

"""The pytest plugin of one run of TRL's GRPO tests (`-p tests.trl_suite.plugin`), set up by `run.py` through the
environment: `load_dataset("trl-internal-testing/<name>", ...)` reads the stand-in dataset directory, `trl.GRPOTrainer`
is grpo-kernels' drop-in when the run is the drop-in's, and each test's outcome goes to a JSON file."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

TRAINER = "GRPO_KERNELS_TRL_SUITE_TRAINER"  # "stock" or "drop-in"
DATASETS = "GRPO_KERNELS_TRL_SUITE_DATASETS"  # the folder of the stand-in datasets, by organisation and name
OUTCOMES = "GRPO_KERNELS_TRL_SUITE_OUTCOMES"  # where the outcomes are written
SELECTION = "GRPO_KERNELS_TRL_SUITE_SELECTION"  # a JSON list of test ids (class::name[params]); absent: every test
SUPPLIED = "GRPO_KERNELS_TRL_SUITE_SUPPLIED"  # a JSON list of "trl.module.is_<package>_available" to supply
TRAINERS = ("stock", "drop-in")

LIGER_ON_CPU = (
    "Liger's Triton kernels need a GPU: on a CPU they fail, and Liger's patches of the model classes then fail every "
    "later test of the process"
)

_outcomes: dict[str, dict[str, str]] = {}
_fused_loss_calls: list[int] = []


def pytest_configure(config) -> None:
    trainer = os.environ.get(TRAINER, "")
    if trainer not in TRAINERS:
        raise ValueError(f"{TRAINER} must be one of {TRAINERS}, got {trainer!r}")
    _supply(json.loads(os.environ.get(SUPPLIED, "[]")))
    import datasets

    datasets.load_dataset = _local_datasets(datasets.load_dataset, Path(os.environ[DATASETS]))
    import torch

    if not torch.cuda.is_available():
        import transformers

        transformers.TrainingArguments.__post_init__ = _on_cpu(transformers.TrainingArguments.__post_init__)
    if trainer == "drop-in":
        import trl

        from grpo_kernels.integrations import trl as drop_in

        trl.GRPOTrainer = drop_in.GRPOTrainer  # TRL's test file imports it from `trl` after this
        drop_in._FusedHead._compute_loss = _counted(drop_in._FusedHead._compute_loss)


def _supply(names: list[str]) -> None:
    """Each "trl.module.is_<package>_available" an older checkout's tests import and the installed TRL lacks, as
    that check (`source.missing_names`), set on its module before the test file is imported."""
    import importlib
    import importlib.util

    from tests.trl_suite.source import AVAILABILITY

    for qualified in names:
        module_name, name = qualified.rsplit(".", 1)
        package = AVAILABILITY.fullmatch(name).group(1)
        check = functools.partial(lambda package: importlib.util.find_spec(package) is not None, package)
        setattr(importlib.import_module(module_name), name, check)


def _counted(compute_loss):
    """The drop-in's loss, counting its calls: a drop-in run that never reached it would prove nothing."""

    @functools.wraps(compute_loss)
    def counted(self, *args, **kwargs):
        _fused_loss_calls.append(1)
        return compute_loss(self, *args, **kwargs)

    return counted


def _on_cpu(post_init):
    @functools.wraps(post_init)
    def on_cpu(self, *args, **kwargs):
        self.use_cpu = True
        return post_init(self, *args, **kwargs)

    return on_cpu


def _local_datasets(load_dataset, root: Path):
    """`load_dataset` reading a Hub name that has a stand-in under `root` from that directory."""

    @functools.wraps(load_dataset)
    def load(path, *args, **kwargs):
        local = root / path if isinstance(path, str) and path.count("/") == 1 else None
        return load_dataset(str(local) if local is not None and local.is_dir() else path, *args, **kwargs)

    return load


def pytest_collection_modifyitems(config, items) -> None:
    """Keep the selected tests (a selected id this TRL's file lacks is reported as "not run"); without a GPU, skip
    the tests that run Liger's Triton kernels (`_needs_liger_kernels`)."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        for item in items:
            if _needs_liger_kernels(item):
                item.add_marker(pytest.mark.skip(reason=LIGER_ON_CPU))
    if SELECTION not in os.environ:
        return
    selection = set(json.loads(os.environ[SELECTION]))
    items[:] = [item for item in items if short_id(item.nodeid) in selection]
    for test in selection - {short_id(item.nodeid) for item in items}:
        _outcomes[test] = {"outcome": "not run", "message": "not in this TRL's test file", "seconds": 0.0}


def _needs_liger_kernels(item) -> bool:
    """A test that trains or computes a loss with `use_liger_kernel=True` (its parameter, or its name)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("use_liger_kernel") is True or re.match(r"test_(train|compute)_\w*liger", item.name) is not None


def short_id(nodeid: str) -> str:
    """`Class::test[params]`: the node id without its file."""
    return nodeid.split("::", 1)[1]


def pytest_runtest_logreport(report) -> None:
    """A test's outcome: its call's, or its setup's when that failed or skipped ("error" for a failed setup or
    teardown), with the first line of the failure."""
    test = short_id(report.nodeid)
    entry = _outcomes.get(test)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "error" if report.when == "setup" and report.failed else report.outcome
        entry = {"outcome": outcome, "message": _first_line(report), "seconds": round(report.duration, 2)}
    elif report.when == "teardown" and report.failed and entry is not None:
        entry = {**entry, "outcome": "error", "message": _first_line(report)}
    if entry is not None:
        _outcomes[test] = entry


def pytest_collectreport(report) -> None:
    """A file that fails to import is one "error" under its path: nothing in it ran."""
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = {
            "outcome": "error",
            "message": _first_line(report),
            "seconds": 0.0,
        }


def _first_line(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    if not report.longrepr:
        return ""
    crash = getattr(report.longrepr, "reprcrash", None)
    return (crash.message if crash is not None else str(report.longrepr)).splitlines()[0][:300]


def pytest_sessionfinish(session) -> None:
    report = {"tests": _outcomes, "fused_loss_calls": len(_fused_loss_calls)}
    Path(os.environ[OUTCOMES]).write_text(json.dumps(report, indent=1, sort_keys=True))

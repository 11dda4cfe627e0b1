"""TRL's own GRPO test file, fetched at run time into a cache pinned to the installed TRL's version; never a copy
in this project.

The PyPI sdist of TRL 1.16 ships no tests/, so the files come from TRL's repository at the tag of the installed
version (`v<version>`), or from a TRL checkout named by `GRPO_KERNELS_TRL_SOURCE` (its `tests/` as it is, for
machines without access to GitHub). They land in `<cache>/<version>/trl_tests/`, a package of their own (its
`testing_utils` import is relative), where `<cache>` is `GRPO_KERNELS_TRL_TESTS` or
`~/.cache/grpo-kernels/trl-tests`.

A checkout older than the installed TRL may import names the installed TRL no longer has (TRL 1.10's
`testing_utils` imports `trl.import_utils.is_joblib_available`): `missing_names` finds them, and those of the form
`is_<package>_available` are supplied to the runs as that check (`plugin.py`); the suite's output lists them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
import re
import shutil
import urllib.request
from pathlib import Path

import trl

FILES = ("test_grpo_trainer.py", "testing_utils.py")  # the test file and the helpers it imports
URL = "https://raw.githubusercontent.com/huggingface/trl/v{version}/tests/{name}"
PACKAGE = "trl_tests"
TIMEOUT_S = 30


class Unavailable(Exception):
    """TRL's test file could not be had; the message says why (the suite skips with it)."""


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_KERNELS_TRL_TESTS") or Path.home() / ".cache" / "grpo-kernels" / "trl-tests")


def fetch_tests() -> tuple[Path, str]:
    """(the folder holding the `trl_tests` package, where its files came from). Raises Unavailable."""
    checkout = os.environ.get("GRPO_KERNELS_TRL_SOURCE")
    if checkout:
        return _from_checkout(Path(checkout))
    version = trl.__version__
    target = cache_root() / version
    package = target / PACKAGE
    origin = URL.format(version=version, name="")
    if all((package / name).is_file() for name in FILES):
        return target, f"{origin} (cached in {package})"
    partial = target / f"{PACKAGE}.partial-{os.getpid()}"  # a concurrent run never reads a half-written package
    partial.mkdir(parents=True, exist_ok=True)
    try:
        for name in FILES:
            url = URL.format(version=version, name=name)
            try:
                with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                    (partial / name).write_bytes(response.read())
            except OSError as error:
                raise Unavailable(f"TRL {version}'s tests/{name} could not be fetched from {url}: {error}") from error
        (partial / "__init__.py").write_text("")
        if not package.exists():
            partial.rename(package)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target, f"{origin} (cached in {package})"


def _from_checkout(checkout: Path) -> tuple[Path, str]:
    """The test files of a TRL checkout, copied into a package beside them in the cache (keyed by its path)."""
    tests = checkout / "tests"
    missing = [name for name in FILES if not (tests / name).is_file()]
    if missing:
        raise Unavailable(f"GRPO_KERNELS_TRL_SOURCE={checkout} has no tests/{', tests/'.join(missing)}")
    version_file = checkout / "VERSION"
    version = version_file.read_text().strip() if version_file.is_file() else "unknown"
    target = cache_root() / "checkouts" / hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:16]
    package = target / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(tests / name, package / name)
    (package / "__init__.py").write_text("")
    return target, f"the TRL checkout {checkout} (version {version}; installed TRL {trl.__version__})"


AVAILABILITY = re.compile(r"is_(\w+)_available")  # a name the suite can supply: whether the package is installed


def missing_names(package: Path) -> list[str]:
    """The names ("trl.module.name") that TRL's test files in `package` import from `trl` and the installed TRL
    lacks, each an availability check the runs supply. Raises Unavailable for one the suite cannot supply."""
    missing = set()
    for file in FILES:
        for module_name, name in _trl_imports(package / file):
            absent = f"TRL's tests/{file} imports {{}}, absent from the installed TRL {trl.__version__}"
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                raise Unavailable(absent.format(module_name)) from None
            if hasattr(module, name):
                continue
            if not AVAILABILITY.fullmatch(name):
                raise Unavailable(absent.format(f"{module_name}.{name}"))
            missing.add(f"{module_name}.{name}")
    return sorted(missing)


def _trl_imports(file: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from trl... import name` in `file`."""
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "trl":
            found += [(node.module, alias.name) for alias in node.names if alias.name != "*"]
    return found

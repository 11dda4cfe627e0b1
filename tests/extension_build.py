"""The objects of this test session's csrc/check_build.sh run (tests/test_check_build.py), so that
tests/test_cuda_build.py need not compile the same CUDA sources again: setup.py compiled each csrc/*.cu for every
architecture of TORCH_CUDA_ARCH_LIST, with torch's own nvcc flags."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_built: list[Path] = []  # the build folder of the check_build.sh run that passed in this session, if any


def record(build_temp: Path) -> None:
    """Note the build folder (setup.py's --build-temp) of a check_build.sh run that passed."""
    _built[:] = [build_temp]


def compiled_archs(source: Path) -> tuple[Path, set[str]] | None:
    """The object this session's check_build.sh compiled from `source` and the SASS architectures it holds
    (cuobjdump --list-elf), or None when no build passed or it did not compile that source."""
    cuobjdump = shutil.which("cuobjdump") or _triton_cuobjdump()
    objects = [o for folder in _built for o in folder.rglob(f"{source.stem}.o")]
    if not objects or cuobjdump is None:
        return None
    listed = subprocess.run([cuobjdump, "--list-elf", str(objects[0])], capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        return None
    return objects[0], {word for line in listed.stdout.split() for word in line.split(".") if word.startswith("sm_")}


def _triton_cuobjdump() -> str | None:
    try:
        from triton import knobs

        return knobs.nvidia.cuobjdump.path
    except Exception:  # no triton, or no cuobjdump in its wheel
        return None

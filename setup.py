"""Packaging lives in pyproject.toml; this file only adds the optional CUDA extension grpo_kernels._C (csrc/).

GRPO_KERNELS_BUILD_CUDA=1 builds it and fails loudly if it cannot, =0 never builds it; unset, it is built when
torch is a CUDA build and nvcc is found (torch's CUDA_HOME), else the install is pure Python. Architectures come
from TORCH_CUDA_ARCH_LIST (default "8.0;9.0"); torch's BuildExtension honours MAX_JOBS. torch must be importable
at build time: pip install --no-build-isolation .   (`import grpo_kernels` never needs the extension.)
"""

from __future__ import annotations

import os
from glob import glob

from setuptools import setup

DEFAULT_ARCHS = "8.0;9.0"


def _refuse(forced: bool, why: str) -> tuple[list, dict]:
    if forced:
        raise RuntimeError(f"GRPO_KERNELS_BUILD_CUDA=1 but grpo_kernels._C cannot be built: {why}")
    return [], {}


def cuda_extension() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for grpo_kernels._C, or ([], {}) when it is not to be built."""
    flag = os.environ.get("GRPO_KERNELS_BUILD_CUDA", "")
    if flag not in ("", "0", "1"):
        raise RuntimeError(f"GRPO_KERNELS_BUILD_CUDA must be 0, 1 or unset, got {flag!r}")
    if flag == "0":
        return [], {}
    forced = flag == "1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as error:
        return _refuse(forced, f"torch is not importable at build time ({error}); use pip install --no-build-isolation")
    if CUDA_HOME is None:
        return _refuse(
            forced,
            f"it needs a CUDA build of torch and nvcc (torch {torch.__version__}, torch.version.cuda "
            f"{torch.version.cuda}; set CUDA_HOME if nvcc is not found)",
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    extension = CUDAExtension(
        "grpo_kernels._C",
        sources=sorted(glob("csrc/*.cu")) + ["csrc/bindings.cpp"],
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

"""Packaging lives in pyproject.toml; this file only exists for the optional CUDA extension (grpo_kernels._C).

The extension's sources arrive with the CUDA backend (csrc/); until then the install is pure Python.
"""

from setuptools import setup

setup()

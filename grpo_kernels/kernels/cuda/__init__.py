"""The CUDA C++ backend: launchers over the `grpo_kernels._C` extension built from `csrc/` (`launchers.py`, which
loads it on first use, never at import), and its record."""

from __future__ import annotations

from grpo_kernels.kernels.cuda import launchers
from grpo_kernels.kernels.protocol import EPILOGUE_KL, HALF_AND_SINGLE, Capabilities

RECORD = Capabilities(
    name="cuda",
    module="grpo_kernels.kernels.cuda.launchers",
    dtypes=HALF_AND_SINGLE,
    usable=lambda device: launchers.cuda_usable(device),  # CUDA tensors and a built extension
    contiguous_vocab=True,
    epilogue_module="grpo_kernels.kernels.cuda.launchers",
    epilogue_kl=EPILOGUE_KL,
)

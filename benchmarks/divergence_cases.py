"""The two-head distillation divergence's benchmark cases: inputs, one forward + backward per provider, and its peak
extra memory measured in a fresh process (`python -m benchmarks.divergence_cases PROVIDER BETA N H V DTYPE MEMORY`).

Providers: `grpo_kernels` (`fused_linear_divergence`), `trl` (TRL 1.16's `ChunkedDivergenceFunction`, its torch tiles
off CUDA), `liger` (`LigerFusedLinearJSD`; CUDA only: its JSD kernel is Triton, which on CPU runs only under the
interpreter). Every provider gets the same student / teacher tensors, all tokens kept, loss = mean over tokens.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

from benchmarks.peak_memory import peak_extra_bytes

PROVIDERS = ("grpo_kernels", "trl", "liger")
# (N, H, V), the teacher as wide as the student; "cpu" has a quarter of the N the GPU sizes run, so that one run
# of every provider fits on a shared 2-core machine
SIZES = {
    "smoke": (64, 32, 1000),
    "cpu": (512, 896, 151936),
    "gpu": (2048, 896, 151936),
    "gpu-short": (2048, 896, 151936),
}


def skip_reason(provider: str, device: torch.device) -> str:
    """Why `provider` cannot run here, or ""."""
    if provider == "trl" and importlib.util.find_spec("trl") is None:
        return "trl is not installed"
    if provider == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed"
        if device.type != "cuda":
            return "Liger's JSD kernel is Triton-only: on CPU only the interpreter runs it, whose time means nothing"
    return ""


def inputs(N: int, H: int, V: int, device: torch.device, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device, dtype)  # noqa: E731
    return {
        "student_hidden": make(N, H).requires_grad_(),
        "student_weight": make(V, H, scale=H**-0.5).requires_grad_(),
        "teacher_hidden": make(N, H),
        "teacher_weight": make(V, H, scale=H**-0.5),
    }


def step(provider: str, beta: float, data: dict, memory: str = "fast"):
    """A callable running one forward + backward of `provider` on `data` (gradients reset first); `memory` is
    `fused_linear_divergence`'s mode."""
    s_h, s_w, t_h, t_w = (data[k] for k in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight"))

    def run() -> None:
        s_h.grad = s_w.grad = None
        loss_of[provider]().backward()
        if s_h.device.type == "cuda":
            torch.cuda.synchronize(s_h.device)

    def ours():
        from grpo_kernels import fused_linear_divergence

        return fused_linear_divergence(s_h, s_w, t_h, t_w, beta=beta, memory=memory).loss

    def trl():
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        return ChunkedDivergenceFunction.apply(s_h, s_w, None, t_h, t_w, None, beta)[0].mean()

    def liger():
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        return LigerFusedLinearJSD(jsd_beta=beta)(s_h, s_w, t_h, t_w)

    loss_of = {"grpo_kernels": ours, "trl": trl, "liger": liger}
    return run


def measure_memory_in_fresh_process(
    provider: str, beta: float, N: int, H: int, V: int, dtype: str = "float32", memory: str = "fast"
) -> int:
    """Peak extra bytes of one forward + backward, measured by a fresh Python process (CPU RSS is only fair there)."""
    import subprocess

    argv = [sys.executable, "-m", "benchmarks.divergence_cases", provider, str(beta), str(N), str(H), str(V), dtype,
            memory]  # fmt: skip
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)["peak_extra_bytes"]


if __name__ == "__main__":
    name, beta_arg, *dims, dtype_arg, memory_arg = sys.argv[1:]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = step(name, float(beta_arg), inputs(*map(int, dims), device, getattr(torch, dtype_arg)), memory_arg)
    print(json.dumps({"peak_extra_bytes": peak_extra_bytes(run, device)}))

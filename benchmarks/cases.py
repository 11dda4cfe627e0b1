"""What each benchmark runs: inputs per shape, and one step per (benchmark, provider, mode).

A case is rebuilt from its names alone, so that the CPU memory measurement can run it in a fresh process
(`python -m benchmarks.cases <bench> <provider> <shape-name> <mode> --bench-size <size>`).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import torch

import grpo_kernels as gk
from benchmarks import baselines
from benchmarks.shapes import SIZES, Shape

BENCHES = ("grpo_loss", "fused_linear", "token_logprobs")
MODES = ("fwd", "fwd_bwd")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def providers(bench: str) -> list[str]:
    """Ours on each available backend, eager PyTorch, torch.compile of it, and Liger's counterpart."""
    ours = ["torch"] + (["triton"] if device().type == "cuda" else [])
    peer = {"grpo_loss": "liger_triton", "fused_linear": "liger_chunked", "token_logprobs": None}[bench]
    return [*ours, "naive", "compile", *([peer] if peer else [])]


def skip_reason(bench: str, provider: str) -> str | None:
    if provider.startswith("liger") and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'grpo-kernels[peers]')"
    if provider == "liger_triton" and device().type != "cuda":
        return "Liger's Triton GRPO loss needs CUDA (under the CPU interpreter it would time the interpreter)"
    return None


def inputs(shape: Shape) -> dict:
    g = torch.Generator(device=device()).manual_seed(0)
    dev = device()
    hidden = torch.randn(shape.B, shape.T, shape.H, generator=g, device=dev).to(shape.dtype)
    weight = (torch.randn(shape.V, shape.H, generator=g, device=dev) / shape.H**0.5).to(shape.dtype)
    targets = torch.randint(0, shape.V, (shape.B, shape.T), generator=g, device=dev)
    mask = torch.rand(shape.B, shape.T, generator=g, device=dev) < 0.78
    with torch.no_grad():
        logp = gk.fused_linear_token_logprobs(hidden, weight, targets)
    return dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        mask=mask,
        advantages=torch.randn(shape.B, generator=g, device=dev),
        old_logp=logp - 0.05,
        ref_logp=logp + 0.1,
    )


def step(bench: str, provider: str, shape: Shape, mode: str, data: dict) -> Callable[[], None]:
    """One timed call: forward, or forward + backward, of `bench` by `provider` on `data`."""
    options = shape.loss_options()
    args = [data[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    backend = provider if provider in ("torch", "triton") else None
    compiled = torch.compile if provider == "compile" else (lambda f: f)
    naive, naive_logprobs = compiled(baselines.naive_loss), compiled(baselines.naive_logprobs)

    def loss() -> torch.Tensor:
        hidden = data["hidden"].requires_grad_(mode == "fwd_bwd")
        weight = data["weight"].requires_grad_(mode == "fwd_bwd")
        if bench == "grpo_loss":  # logits in: the lm_head GEMM is outside the timed loss in every provider
            logits = data["logits"].detach().requires_grad_(mode == "fwd_bwd")
            data["leaf"] = logits
            if backend:
                return gk.grpo_loss(logits, *args, backend=backend, **options).loss
            if provider == "liger_triton":
                return baselines.liger_triton_loss(logits, *args, **options)
            return naive(logits, *args, **options)
        if bench == "token_logprobs":
            if backend:
                return gk.fused_linear_token_logprobs(
                    hidden, weight, data["targets"], mask=data["mask"], backend=backend
                ).sum()
            return naive_logprobs(hidden, weight, data["targets"], data["mask"]).sum()
        if backend:
            return gk.fused_linear_grpo_loss(hidden, weight, *args, backend=backend, **options).loss
        if provider == "liger_chunked":
            return baselines.liger_chunked_loss(hidden, weight, *args, **options)
        return naive(hidden @ weight.T, *args, **options)

    if bench == "grpo_loss":
        data.setdefault("logits", (data["hidden"] @ data["weight"].T).detach())
        data.setdefault("pristine", data["logits"].clone())

    def run() -> None:
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            out = loss()
            if mode == "fwd_bwd" and bench == "grpo_loss":  # dL/dlogits, as a trainer's lm_head backward gets it
                torch.autograd.grad(out, data["leaf"])  # (.backward() into a leaf would time a copy of it)
            elif mode == "fwd_bwd":
                out.backward()
        for x in (data["hidden"], data["weight"], data.get("leaf")):
            if x is not None:
                x.grad = None
        if device().type == "cuda":
            torch.cuda.synchronize()

    return run


def restore(data: dict) -> None:
    """Untimed, before each round: the in-place backward leaves dL/dlogits where the logits were."""
    if "pristine" in data:
        data["logits"].copy_(data["pristine"])


def peak_extra_bytes(bench: str, provider: str, shape: Shape, mode: str, data: dict) -> int:
    """Peak memory of one call beyond what existed before it: CUDA allocator stats, or (CPU) VmHWM − VmRSS
    of a fresh process running the case alone."""
    if device().type == "cuda":
        run = step(bench, provider, shape, mode, data)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - base
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cases", bench, provider, shape.name, mode, shape.size],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.split()[-1])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


if __name__ == "__main__":  # the CPU memory measurement of one case, in this fresh process
    bench, provider, name, mode, size = sys.argv[1:6]
    shape = next(s for s in SIZES[size] if s.name == name)
    data = inputs(shape)
    run = step(bench, provider, shape, mode, data)
    with open("/proc/self/clear_refs", "w") as clear:  # peak RSS := current RSS
        clear.write("5")
    base = _status_kib("VmRSS")
    run()
    print((_status_kib("VmHWM") - base) * 1024)

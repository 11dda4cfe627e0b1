"""What each benchmark runs: inputs per shape, and one step per (benchmark, provider, mode).

A case is rebuilt from its names alone, so that the CPU memory measurement can run it in a fresh process
(`python -m benchmarks.cases <bench> <provider> <shape-name> <mode> --bench-size <size>`).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable

import torch

import grpo_kernels as gk
from benchmarks import baselines
from benchmarks.peak_memory import peak_extra_bytes as measure_peak
from benchmarks.shapes import SIZES, Shape

BENCHES = ("grpo_loss", "fused_linear", "token_logprobs")
MODES = ("fwd", "fwd_bwd")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


LEAN = "_lean"  # a provider suffix: our fused lm_head with memory="lean" (2-D tiles, vocabulary-major backward)


def providers(bench: str) -> list[str]:
    """Ours on each available backend (the fused lm_head also with `memory="lean"`: `<backend>_lean`), eager
    PyTorch, torch.compile of it, and the peers' counterparts (Liger, TRL 1.16's fused head)."""
    backends = ["torch"] + (["triton"] if device().type == "cuda" else [])
    ours = backends if bench == "grpo_loss" else [*backends, *(b + LEAN for b in backends)]
    peers = {"grpo_loss": ["liger_triton"], "fused_linear": ["liger_chunked", "trl"], "token_logprobs": ["trl"]}
    return [*ours, "naive", "compile", *peers[bench]]


def skip_reason(bench: str, provider: str) -> str | None:
    if provider.startswith("liger") and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'grpo-kernels[peers]')"
    if provider == "liger_triton" and device().type != "cuda":
        return "Liger's Triton GRPO loss needs CUDA (under the CPU interpreter it would time the interpreter)"
    if provider == "trl" and importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install 'grpo-kernels[trl]')"
    if provider == "trl" and importlib.util.find_spec("trl.kernels.chunked_logprob") is None:
        return "this trl has no fused LM head (trl.kernels.chunked_logprob, TRL >= 1.16)"
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
    """One timed call: forward, or forward + backward, of `bench` by `provider` on `data`. The fused cases also
    return the per-token entropy, as a GRPO trainer's head does for its `entropy` metric (TRL's always; Liger's
    loss has no entropy output); its gradient is not taken."""
    options = shape.loss_options()
    args = [data[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    backend = provider.removesuffix(LEAN) if provider.removesuffix(LEAN) in ("torch", "triton") else None
    memory = "lean" if provider.endswith(LEAN) else "auto"
    compiled = torch.compile if provider == "compile" else (lambda f: f)
    naive, naive_logprobs = compiled(baselines.naive_loss), compiled(baselines.naive_logprobs)
    naive_entropy = compiled(baselines.naive_entropy)

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
                fused = dict(mask=data["mask"], with_entropy=True, backend=backend, memory=memory)
                logp, _ = gk.fused_linear_token_logprobs(hidden, weight, data["targets"], **fused)
            elif provider == "trl":
                logp, _ = baselines.trl_logprobs(hidden, weight, data["targets"], data["mask"])
            else:
                logp, _ = naive_logprobs(hidden, weight, data["targets"], data["mask"])
            return logp.sum()
        if backend:
            return gk.fused_linear_grpo_loss(
                hidden, weight, *args, with_entropy=True, backend=backend, memory=memory, **options
            ).loss
        if provider == "liger_chunked":
            return baselines.liger_chunked_loss(hidden, weight, *args, **options)
        if provider == "trl":
            return baselines.trl_loss(hidden, weight, *args, **options)
        logits = hidden @ weight.T  # [B, T, V]
        naive_entropy(logits)  # the entropy metric, as eager TRL took it beside the loss
        return naive(logits, *args, **options)

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


def best_seconds(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device().type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def floor_seconds(bench: str, mode: str, data: dict) -> float:
    """The physical floor, timed: the lm_head GEMMs (fused cases) or a copy of the bytes the logits-level loss must
    move (read the logits twice and write the gradient once; forward: read once). Outputs go to buffers allocated
    once, so the floor times no page faults or allocator work."""
    if bench == "grpo_loss":
        logits = data["pristine"]
        moves = 3 if mode == "fwd_bwd" else 1
        out = torch.empty_like(logits)
        return moves / 2 * best_seconds(lambda: out.copy_(logits))  # a copy reads and writes: 2 moves
    h, w = data["hidden"].detach().flatten(0, 1), data["weight"].detach()
    logits, dh, dw = h.new_empty(h.shape[0], w.shape[0]), torch.empty_like(h), torch.empty_like(w)
    gemms = [lambda: torch.mm(h, w.T, out=logits)]
    if mode == "fwd_bwd":
        gemms += [lambda: torch.mm(logits, w, out=dh), lambda: torch.mm(logits.T, h, out=dw)]
    return sum(best_seconds(g) for g in gemms)


def restore(data: dict) -> None:
    """Untimed, before each round: the in-place backward leaves dL/dlogits where the logits were."""
    if "pristine" in data:
        data["logits"].copy_(data["pristine"])


def peak_extra_bytes(bench: str, provider: str, shape: Shape, mode: str, data: dict) -> int:
    """Peak memory of one call beyond what existed before it: CUDA allocator stats, or (CPU) VmHWM − VmRSS
    of a fresh process running the case alone."""
    if device().type == "cuda":
        return measure_peak(step(bench, provider, shape, mode, data))
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cases", bench, provider, shape.name, mode, shape.size],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.split()[-1])


PEER_MODULES = {  # what each peer imports on its first call
    "liger_triton": ("liger_kernel.transformers.grpo_loss",),
    "liger_chunked": ("liger_kernel.chunked_loss",),
    "trl": ("trl.kernels.chunked_logprob", "trl.trainer.utils"),
}


def preload(provider: str) -> None:
    """Import a peer's modules, so that a fresh process's peak counts the case and not the import."""
    for module in PEER_MODULES.get(provider, ()):
        importlib.import_module(module)


if __name__ == "__main__":  # the CPU memory measurement of one case, in this fresh process
    bench, provider, name, mode, size = sys.argv[1:6]
    shape = next(s for s in SIZES[size] if s.name == name)
    data = inputs(shape)
    run = step(bench, provider, shape, mode, data)
    preload(provider)
    print(measure_peak(run))


def case_info(bench: str, provider: str, shape, mode: str, size: str) -> dict:
    """What a result records about its case and machine (pytest-benchmark's `extra_info`)."""
    return dict(
        bench=bench,
        provider=provider,
        mode=mode,
        shape=shape.name,
        N=shape.N,
        V=shape.V,
        H=shape.H,
        loss=shape.loss,
        dtype=str(shape.dtype),
        size=size,
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if device().type == "cuda" else "cpu",
    )

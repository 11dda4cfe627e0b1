"""The headline GPU numbers: one fused lm_head + GRPO loss step (forward + backward) against the bare lm_head GEMMs,
TRL 1.16's fused head, Liger's fused GRPO loss and eager PyTorch, and the vocabulary kernels' bandwidth.

    python -m benchmarks.headline --out DIR                  # CUDA: bf16, H 4,096, V 151,936, N 8,192 and 16,384
    python -m benchmarks.headline --size smoke --out DIR     # any device, tiny: the code path, no meaningful number

The step: dapo, epsilon_high 0.28, beta 0.04 with the bias-corrected k3 KL, the entropy computed, ~12% of the tokens
masked (the last quarter of half the sequences), B 16 sequences. Providers:
- `gemms`: the three lm_head GEMMs (logits = h·Wᵀ, g·W, gᵀ·h) in the input dtype, the time floor;
- `ours` (`fused_linear_grpo_loss`, memory "auto") and `ours_lean` (memory "lean");
- `trl`: TRL 1.16's `ChunkedLogProbFunction` as GRPOTrainer calls it, then its `_compute_loss` algebra
  (`benchmarks.baselines.trl_loss`);
- `liger`: Liger's `LigerFusedLinearGRPOLoss` (compiled=False; `baselines.liger_chunked_loss`);
- `eager`: bf16 logits → float32 log_softmax, the entropy, TRL's algebra (`baselines.naive_logprobs`).
Eager, Liger and lean run at the first N only (eager holds [N, V] float32 several times). A peer that is not
importable is skipped with the reason. Time: CUDA events, median of `--iters` after 2 warm-ups (CPU: wall clock);
memory: peak allocated above what existed before the call, the gradients included (CUDA only). Parity: loss, dH and
dW of ours against TRL and eager at the first N (max |a − b| / max |b|).

Bandwidth: `token_logprobs` with the entropy on [B, T, V] logits (the logits read once) and `grpo_loss` forward +
in-place backward (read, then read and written), timed by the profiler's kernel time (CUDA kernels whose name holds
`_kernel`), as bytes moved / kernel time, beside the device's nominal bandwidth when known. The same cases as the
2026-11-26 H100 run (one H100 80GB HBM3, torch 2.11, triton 3.6): see docs/gpu_run.md.

Writes DIR/headline.json and DIR/headline.md after every case (a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import grpo_kernels as gk
from benchmarks import baselines

SIZES = {
    "gpu": dict(N=(8192, 16384), H=4096, V=151_936, dtype=torch.bfloat16, B=16),
    "smoke": dict(N=(32, 64), H=16, V=500, dtype=torch.float32, B=4),
}
OPTIONS = dict(loss_type="dapo", epsilon_high=0.28, beta=0.04, use_bias_correction_kl=True)
FIRST_N_ONLY = ("ours_lean", "liger", "eager")
NOMINAL_TBPS = {"H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H200": 4.8, "A100-SXM4-80GB": 2.04}


def problem(N: int, size: dict, device: torch.device) -> dict:
    """hidden [B, T, H], weight [V, H], targets, mask, advantages, old/ref log-probs near the policy's."""
    B, H, V = size["B"], size["H"], size["V"]
    T = N // B
    g = torch.Generator(device=device).manual_seed(0)
    p = dict(
        hidden=(torch.randn(B, T, H, generator=g, device=device) * 0.5).to(size["dtype"]),
        weight=(torch.randn(V, H, generator=g, device=device) * 0.02).to(size["dtype"]),
        targets=torch.randint(0, V, (B, T), generator=g, device=device),
        advantages=torch.randn(B, generator=g, device=device),
    )
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    mask[:, T * 3 // 4 :] = torch.rand(B, 1, generator=g, device=device) > 0.5  # some shorter completions
    p["mask"] = mask
    with torch.no_grad():
        logp = gk.fused_linear_token_logprobs(p["hidden"], p["weight"], p["targets"]).float()  # [B, T]
    p["old_logp"] = logp + 0.02 * torch.randn(B, T, generator=g, device=device)
    p["ref_logp"] = logp + 0.02 * torch.randn(B, T, generator=g, device=device)
    return p


def _leaves(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return p["hidden"].detach().requires_grad_(), p["weight"].detach().requires_grad_()


def _policy(p: dict) -> list[torch.Tensor]:
    return [p[k] for k in ("advantages", "old_logp", "ref_logp", "mask")]


def providers(p: dict) -> dict[str, Callable[[], tuple]]:
    """name -> step() returning (loss, dH, dW) (the GEMMs: their outputs)."""
    H = p["hidden"].shape[-1]

    def gemms():
        h = p["hidden"].view(-1, H)
        logits = h @ p["weight"].T  # [N, V]
        return None, logits @ p["weight"], logits.T @ h

    def ours(memory: str) -> Callable:
        def step():
            h, w = _leaves(p)
            policy = _policy(p)
            out = gk.fused_linear_grpo_loss(h, w, p["targets"], *policy, with_entropy=True, memory=memory, **OPTIONS)
            out.loss.backward()
            return out.loss.detach(), h.grad, w.grad

        return step

    def trl():
        h, w = _leaves(p)
        loss = baselines.trl_loss(h, w, p["targets"], *_policy(p), **OPTIONS)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def liger():
        h, w = _leaves(p)
        options = dict(loss_type="dapo", epsilon_high=0.28, beta=0.04)
        loss = baselines.liger_chunked_loss(h, w, p["targets"], *_policy(p), **options)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def eager():
        h, w = _leaves(p)
        logp, _entropy = baselines.naive_logprobs(h, w, p["targets"], p["mask"])  # [B, T] each
        loss = baselines.trl_grpo_algebra(logp, *_policy(p), **OPTIONS)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    return dict(gemms=gemms, ours=ours("auto"), ours_lean=ours("lean"), trl=trl, liger=liger, eager=eager)


def missing_peer(name: str) -> str | None:
    """Why the provider cannot run here, or None."""
    module = {"trl": "trl.kernels.chunked_logprob", "liger": "liger_kernel.chunked_loss"}.get(name)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as error:  # noqa: BLE001 - any import failure means the peer is not usable here
        return f"not importable: {type(error).__name__}: {error}"
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(step: Callable, device: torch.device, iters: int) -> dict:
    """Median and min ms of `iters` calls after 2 warm-ups; peak extra bytes of one more (CUDA)."""
    for _ in range(2):
        step()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    peak = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    return dict(median_ms=statistics.median(times), min_ms=min(times), peak_extra_bytes=peak)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def parity(steps: dict[str, Callable]) -> dict:
    """Ours against TRL and eager (whichever ran): loss difference, dH and dW relative."""
    out = {}
    loss, dh, dw = steps["ours"]()
    for name in ("trl", "eager"):
        if name in steps:
            other_loss, other_dh, other_dw = steps[name]()
            out[name] = dict(loss_ours=loss.item(), loss=other_loss.item(), loss_abs=abs(loss - other_loss).item(),
                             dH_rel=relative(dh, other_dh), dW_rel=relative(dw, other_dw))  # fmt: skip
    return out


def kernel_ms(fn: Callable, device: torch.device, calls: int = 3) -> float | None:
    """Device kernel time per call of `fn` from the profiler (kernels named *_kernel*); None off CUDA."""
    if device.type != "cuda":
        fn()
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if "_kernel" in e.key)
    return total_us / 1e3 / calls


def bandwidth(p: dict, device: torch.device) -> dict:
    """The vocabulary kernels' bytes moved / kernel time on logits [B, T, V] = hidden·Wᵀ."""
    B, T, _ = p["hidden"].shape
    logits = (p["hidden"].view(B * T, -1) @ p["weight"].T).view(B, T, -1)  # [B, T, V]
    nbytes = logits.numel() * logits.element_size()
    buffer = logits.clone()

    def forward():
        with torch.no_grad():
            gk.token_logprobs(logits, p["targets"], with_entropy=True, mask=p["mask"])

    def loss_step():
        buffer.copy_(logits)  # a copy kernel is no `_kernel`: it is not counted
        x = buffer.detach().requires_grad_()
        out = gk.grpo_loss(x, p["targets"], *_policy(p), inplace=True, **OPTIONS)
        out.loss.backward(inputs=[x])

    out = dict(logits_bytes=nbytes)
    for name, fn, moved in (("token_logprobs_fwd", forward, nbytes), ("grpo_loss_fwd_bwd", loss_step, 3 * nbytes)):
        ms = kernel_ms(fn, device)
        out[name] = dict(kernel_ms=ms, bytes=moved, tbps=None if ms is None else moved / (ms / 1e3) / 1e12)
    return out


def markdown(result: dict) -> str:
    lines = [f"# Headline step on {result['device']} (torch {result['torch']}, triton {result['triton']})", ""]
    lines += [f"dtype {result['dtype']}, H {result['H']:,}, V {result['V']:,}; {result['loss']}", ""]
    lines += ["| N | provider | median ms | × gemms | peak extra MiB |", "|---|---|---|---|---|"]
    for N, cases in result["cases"].items():
        floor = cases.get("gemms", {}).get("median_ms")
        for name, r in cases.items():
            if "skipped" in r or "error" in r:
                lines.append(f"| {N} | {name} | {r.get('skipped') or r.get('error')} | | |")
                continue
            ratio = f"{r['median_ms'] / floor:.2f}" if floor else "—"
            peak = "—" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:,.0f}"
            lines.append(f"| {N} | {name} | {r['median_ms']:.2f} | {ratio} | {peak} |")
    if result.get("parity"):
        lines += ["", "Parity of ours (loss, max relative dH, dW): " + json.dumps(result["parity"])]
    if result.get("bandwidth"):
        lines += ["", "| vocabulary pass | kernel ms | TB/s |", "|---|---|---|"]
        for name in ("token_logprobs_fwd", "grpo_loss_fwd_bwd"):
            r = result["bandwidth"][name]
            ms = "—" if r["kernel_ms"] is None else f"{r['kernel_ms']:.3f}"
            tbps = "—" if r["tbps"] is None else f"{r['tbps']:.2f}"
            lines.append(f"| {name} | {ms} | {tbps} |")
        if result.get("nominal_tbps"):
            lines.append(f"\nNominal HBM bandwidth: {result['nominal_tbps']} TB/s.")
    return "\n".join(lines) + "\n"


def run(size_name: str, iters: int, out: Path, device: torch.device) -> dict:
    import triton

    size = SIZES[size_name]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = dict(
        device=name, torch=torch.__version__, triton=triton.__version__, size=size_name, dtype=str(size["dtype"]),
        H=size["H"], V=size["V"], B=size["B"], loss=json.dumps(OPTIONS), iters=iters, cases={}, parity={},
        nominal_tbps=next((v for k, v in NOMINAL_TBPS.items() if k in name), None),
    )  # fmt: skip

    def save():
        out.mkdir(parents=True, exist_ok=True)
        (out / "headline.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "headline.md").write_text(markdown(result))

    for i, N in enumerate(size["N"]):
        p = problem(N, size, device)
        steps = providers(p)
        cases = result["cases"][str(N)] = {}
        for provider, step in list(steps.items()):
            why = missing_peer(provider) or ("first N only" if i and provider in FIRST_N_ONLY else None)
            if why:
                cases[provider] = dict(skipped=why)
                steps.pop(provider)
                continue
            try:
                cases[provider] = time_step(step, device, iters)
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                cases[provider] = dict(error=f"{type(error).__name__}: {error}"[:500])
                steps.pop(provider)
                traceback.print_exc()
            print(f"N {N} {provider}: {cases[provider]}", flush=True)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if i == 0:
            result["parity"] = parity(steps)
            result["bandwidth"] = bandwidth(p, device)
            save()
        del p, steps
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu" if torch.cuda.is_available() else "smoke")
    parser.add_argument("--iters", type=int, default=7, help="timed calls per case (after 2 warm-ups)")
    parser.add_argument("--out", type=Path, required=True, help="folder for headline.json and headline.md")
    args = parser.parse_args(argv)
    if args.size == "gpu" and not torch.cuda.is_available():
        parser.error("--size gpu needs a CUDA device; use --size smoke here")
    if args.iters < 1:
        parser.error(f"--iters takes a count >= 1, got {args.iters}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    result = run(args.size, args.iters, args.out, device)
    print(markdown(result))
    failed = [f"{N} {p}" for N, cases in result["cases"].items() for p, r in cases.items() if "error" in r]
    if failed:
        print(f"headline: failed cases: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

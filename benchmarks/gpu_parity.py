"""Float64-oracle parity of every backend at real sizes: the GPU run's correctness step (`benchmarks/run_gpu.sh`).

    python -m benchmarks.gpu_parity --out DIR                                  # CUDA: size gpu, torch/triton/cuda
    python -m benchmarks.gpu_parity --size smoke --backends torch --out DIR    # the CPU check of --dry-run

Ops: the log-prob + entropy pass on logits (`token_logprobs`), the logits-level loss (`grpo_loss`: dapo, grpo,
gspo, sapo, each with beta = 0.04 and the entropy metric), the fused lm_head pass (`fused_linear_token_logprobs`)
and loss (`fused_linear_grpo_loss`: dapo, gspo); values, metrics and every gradient; bf16, fp16 and fp32. Size gpu:
B = 64 sequences of T = 256 (N = 16,384 tokens, 78% kept), V = 151,936, H = 4,096.

The oracle is `grpo_kernels.reference`, run by `benchmarks.parity_reference`. Its vocabulary pass
(`reference.token_logprobs`) runs on the device in float64 over chunks of rows, so [N, V] float64 never exists
whole; its loss algebra (`reference.grpo_loss`) runs on the CPU, fed those float64 log-probs and entropies, and
autograd gives dL/dlogp and dL/dH per token, which each chunk's float64 backward turns into dL/dlogits (and
dL/dhidden, dL/dweight for the fused head).

Tolerance, as Cut Cross-Entropy holds its kernels at real sizes: the same run also measures a plain same-dtype
implementation against the oracle, and a quantity passes when

    max |ours − oracle| <= max(RTOL[dtype], 2 · max |plain − oracle| / max |oracle|) · max |oracle|

per tensor (scale-relative errors; RTOL is `tests/conftest.py`'s table, which the CPU tests keep). The plain
implementation is what a user would write: the logits materialised in the input dtype (fused ops: hidden @ weightᵀ
in that dtype), `torch.log_softmax` in that dtype, gather and entropy, the loss algebra of `reference.grpo_loss` on
those, gradients by autograd. At V = 151,936 a plain float32 reduction itself errs by ~1e-5 of the scale (e.g.
dL/dhidden, a sum over V), so RTOL alone would fail a kernel for the rounding every float32 implementation has;
twice the plain error is the bar there, and RTOL elsewhere. Both errors are reported side by side. The plain run
holds ~7 [kept rows, V] tensors of the input dtype at once (~55 GB for fp32 at size gpu).

The inputs keep every importance ratio away from the clip boundaries (per-token log-ratios of
±0.05 or ±0.5 around a per-sequence base, so GSPO's sequence ratios too), so that rounding cannot flip a clip
decision and the comparison measures the kernels' arithmetic. Masked rows hold NaN: never read, gradient 0.

Writes DIR/parity.json and DIR/parity.md after every backend run (a timeout keeps what was done); prints
`PARITY FAILED` lines and exits 1 when a quantity exceeds its tolerance, a backend raised, or it did not run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import grpo_kernels as gk
from benchmarks.gpu_run import failure_line, parity_markdown
from benchmarks.parity_reference import (
    F64,
    device,
    fused_oracle_grads,
    oracle_backward,
    oracle_chunk_rows,
    oracle_forward,
    oracle_loss,
    run_plain,
    sync,
)
from grpo_kernels.kernels import backend as backends
from tests.conftest import RTOL

SIZES = {"smoke": dict(B=4, T=16, V=1000, H=32), "gpu": dict(B=64, T=256, V=151936, H=4096)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
LOSSES = {
    "dapo": dict(loss_type="dapo", epsilon_high=0.28, beta=0.04),
    "grpo": dict(loss_type="grpo", beta=0.04),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "sapo": dict(loss_type="sapo", beta=0.04),
}
CASES = {  # op -> its loss cases ("-": the log-prob pass, with a random weighted sum of logp and entropy as loss)
    "token_logprobs": ("-",),
    "grpo_loss": ("dapo", "grpo", "gspo", "sapo"),
    "fused_linear_token_logprobs": ("-",),
    "fused_linear_grpo_loss": ("dapo", "gspo"),
}


class Tally:
    """Max |actual − expected| and max |expected| of one quantity, accumulated over chunks."""

    def __init__(self) -> None:
        self.err, self.scale = 0.0, 0.0

    def add(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        actual = actual.double()
        expected = expected.to(actual.device, F64)
        if expected.numel():
            self.err = max(self.err, (actual - expected).abs().max().item(), key=_nan_first)
            self.scale = max(self.scale, expected.abs().max().item())

    def zero(self, actual: torch.Tensor) -> None:
        """Entries whose expected value is exactly 0 (masked rows)."""
        if actual.numel():
            self.err = max(self.err, actual.double().abs().max().item(), key=_nan_first)

    def result(self, dtype: torch.dtype, plain: Tally | None = None) -> dict:
        """The error relative to the scale, the plain implementation's beside it, and the pass verdict: within
        max(RTOL[dtype], 2 × the plain relative error) of the scale (a non-finite plain error counts as absent)."""
        scale = max(self.scale, 1e-6)
        plain_rel = None if plain is None or not math.isfinite(plain.err) else plain.err / scale
        tol = max(RTOL[dtype], 2 * plain_rel) if plain_rel is not None else RTOL[dtype]
        return dict(
            err=self.err,
            scale=self.scale,
            rel=self.err / scale,
            rtol=RTOL[dtype],
            plain_rel=plain_rel,
            tol=tol,
            ok=bool(self.err <= tol * scale),
        )  # NaN compares False: a non-finite error fails


def _nan_first(x: float) -> float:
    return math.inf if math.isnan(x) else x


def make_inputs(size: dict, dtype: torch.dtype, fused: bool, seed: int) -> dict:
    """Logits [B, T, V] (fused: hidden [B, T, H] and weight [V, H]) with NaN in masked rows, targets (0 and V − 1
    among them), mask, advantages [B], and the weights of the log-prob pass's loss."""
    B, T, V, H = size["B"], size["T"], size["V"], size["H"]
    dev = device()
    g = torch.Generator(device=dev).manual_seed(seed)
    mask = torch.rand(B, T, generator=g, device=dev) < 0.78
    mask[:, 0] = True  # no empty sequence
    targets = torch.randint(0, V, (B, T), generator=g, device=dev)
    targets[0, :2] = torch.tensor([0, V - 1])
    inp = dict(mask=mask, targets=targets, kept=mask.flatten().nonzero().squeeze(1))
    # per-sequence log-ratio base (see add_policy_inputs); advantages' signs make every clip branch occur
    inp["base"] = torch.tensor([-0.5, -0.05, 0.05, 0.5], dtype=F64).repeat(B // 4 + 1)[:B, None]  # [B, 1]
    sign = inp["base"].sign().squeeze(1) * torch.where(torch.arange(B) % 8 < 4, 1.0, -1.0).double()  # [B]
    inp["advantages"] = torch.randn(B, generator=g, device=dev).abs() * sign.float().to(dev)
    inp["w_logp"] = torch.randn(B, T, generator=g, device=dev) * mask
    inp["w_ent"] = torch.randn(B, T, generator=g, device=dev) * mask
    if fused:
        inp["hidden"] = torch.randn(B, T, H, generator=g, device=dev).to(dtype)
        inp["hidden"][~mask] = float("nan")
        inp["weight"] = (torch.randn(V, H, generator=g, device=dev) / H**0.5).to(dtype)
    else:
        inp["logits"] = (2 * torch.randn(B, T, V, generator=g, device=dev)).to(dtype)
        inp["logits"][~mask] = float("nan")
    return inp


def add_policy_inputs(inp: dict, logp64: torch.Tensor, seed: int) -> None:
    """old_logp and ref_logp [B, T] (float32) from the oracle's logp. Log-ratios: ±0.05 or ±0.5 per sequence (the
    `base` of make_inputs), ±0.02 per token: away from the clip range's ends (1 − 0.2, 1 + 0.28) at token and at
    sequence level. ref at least 0.2 away (k3 ≈ d²/2 would otherwise measure the rounding of the inputs, as
    tests/helpers.py says)."""
    B, T = inp["mask"].shape
    g = torch.Generator().manual_seed(seed + 1)
    log_ratio = inp["base"] + 0.02 * (1 - 2 * (torch.arange(T) % 2))  # [B, T]
    d = torch.randn(B, T, generator=g, dtype=F64)
    logp = torch.zeros(B * T, dtype=F64)
    logp[inp["kept"].cpu()] = logp64.cpu()
    logp = logp.view(B, T)
    mask = inp["mask"].cpu()
    inp["old_logp"] = ((logp - log_ratio) * mask).float().to(device())
    inp["ref_logp"] = ((logp + d.sign() * (0.2 + 0.3 * d.abs())) * mask).float().to(device())


def run_ours(op: str, backend: str, inp: dict, options: dict) -> tuple[dict, dict]:
    """Our op on fresh leaves: ({name: value}, {name: gradient})."""
    kw = dict(mask=inp["mask"], with_entropy=True, backend=backend)
    policy = [inp[k] for k in ("advantages", "old_logp", "ref_logp", "mask")] if op.endswith("grpo_loss") else []
    if op.startswith("fused_linear"):
        leaves = dict(hidden=inp["hidden"].clone().requires_grad_(), weight=inp["weight"].clone().requires_grad_())
        args = (leaves["hidden"], leaves["weight"], inp["targets"])
    else:
        leaves = dict(logits=inp["logits"].clone().requires_grad_())  # the backward writes into this copy
        args = (leaves["logits"], inp["targets"])
    if op.endswith("grpo_loss"):
        kw.pop("mask")
        out = getattr(gk, op)(*args, *policy, **kw, **options)
        values = {"loss": out.loss, **{f"metric {k}": v for k, v in out.metrics.items()}}
        loss = out.loss
    else:
        logp, ent = getattr(gk, op)(*args, **kw)
        values = dict(logp=logp, entropy=ent)
        loss = (logp * inp["w_logp"] + ent * inp["w_ent"]).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    sync()
    return {k: v.detach() for k, v in values.items()}, dict(zip([f"grad {k}" for k in leaves], grads, strict=True))


def compare(op: str, inp: dict, oracle: dict, values: dict, grads: dict, z_of, chunk: int) -> dict[str, Tally]:
    """Tallies of every value and gradient of ours against the oracle."""
    tallies = {}
    kept = inp["kept"]
    masked = (~inp["mask"]).flatten().nonzero().squeeze(1)
    for name, ours in values.items():
        t = tallies[name] = Tally()
        if name in ("logp", "entropy"):
            t.add(ours.flatten()[kept], oracle[name])
            t.zero(ours.flatten()[masked])
        elif name == "loss":
            t.add(ours, oracle["loss"])
        elif name.removeprefix("metric ") in oracle["metrics"]:
            t.add(ours, oracle["metrics"][name.removeprefix("metric ")])
        else:
            del tallies[name]
    if op.startswith("fused_linear"):
        for name, key in (("grad hidden", "d_hidden"), ("grad weight", "d_weight")):
            t = tallies[name] = Tally()
            ours = grads[name].flatten(0, -2) if name == "grad hidden" else grads[name]
            t.add(ours[kept] if name == "grad hidden" else ours, oracle[key])
            if name == "grad hidden":
                t.zero(ours[masked])
        return tallies
    t = tallies["grad logits"] = Tally()
    ours = grads["grad logits"].flatten(0, -2)  # [B·T, V]
    for rows, expected in oracle_backward(z_of, oracle["targets"], oracle["g_logp"], oracle["g_ent"], chunk):
        t.add(ours[kept[rows]], expected)
    for s in range(0, len(masked), chunk):
        t.zero(ours[masked[s : s + chunk]])
    return tallies


def run(size_name: str, backend_names: list[str], dtype_names: list[str], ops: list[str], out: Path) -> int:
    size = SIZES[size_name]
    records: list[dict] = []
    header = dict(size=size_name, **size, device=_device_name(), torch=torch.__version__, rtol=_rtol_names())
    header["tolerance"] = "max(RTOL[dtype], 2 x the plain same-dtype implementation's error), relative to the scale"
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        for fused in (False, True):
            fused_ops = [op for op in ops if op.startswith("fused_linear") == fused]
            if fused_ops:
                _run_block(size, dtype, dtype_name, fused, fused_ops, backend_names, records, header, out)
    failures = [r for r in records if not r["ok"]]
    for r in failures:
        print(f"PARITY FAILED: {failure_line(r)}", file=sys.stderr)
    print(f"parity: {len(records) - len(failures)} of {len(records)} checks within tolerance -> {out}")
    return 1 if failures else 0


def _run_block(size, dtype, dtype_name, fused, ops, backend_names, records, header, out) -> None:
    """One dtype, logits-level or fused: inputs, the oracle's forward, then per op and loss case the oracle's loss
    and every backend."""
    V, H = size["V"], size["H"]
    inp = make_inputs(size, dtype, fused, seed=0)
    chunk = oracle_chunk_rows(V, H if fused else 0)
    if fused:
        h64 = inp["hidden"].flatten(0, 1)[inp["kept"]].double()
        w64 = inp["weight"].double()
        z_of = lambda rows: h64[rows] @ w64.T  # noqa: E731
    else:
        flat = inp["logits"].flatten(0, 1)
        z_of = lambda rows: flat[inp["kept"][rows]].double()  # noqa: E731
    targets = inp["targets"].flatten()[inp["kept"]]
    logp64, ent64 = oracle_forward(z_of, targets, chunk)
    add_policy_inputs(inp, logp64, seed=0)
    for op in ops:
        for case in CASES[op]:
            options = LOSSES.get(case, {})
            oracle = dict(logp=logp64, entropy=ent64, targets=targets, metrics={})
            if case == "-":
                kept = inp["kept"]
                oracle.update(
                    g_logp=inp["w_logp"].flatten()[kept].double(), g_ent=inp["w_ent"].flatten()[kept].double()
                )
            else:
                loss, metrics, g_logp, g_ent = oracle_loss(logp64, ent64, inp, options)
                oracle.update(loss=loss, metrics=metrics, g_logp=g_logp, g_ent=g_ent)
            if fused:
                fused_oracle_grads(z_of, oracle, h64, w64, chunk)
            values, grads = run_plain(op, inp, options)
            plain = compare(op, inp, oracle, values, grads, z_of, chunk)
            del values, grads
            _free()
            for backend in backend_names:
                base = dict(
                    op=op,
                    loss=case,
                    dtype=dtype_name,
                    backend=backend,
                    N=inp["mask"].numel(),
                    kept=len(targets),
                    V=V,
                    H=H if fused else None,
                )
                records += _check_backend(op, backend, inp, options, oracle, z_of, chunk, dtype, base, plain)
                _write(out, header, records)
            oracle.clear()
            _free()


def _check_backend(op, backend, inp, options, oracle, z_of, chunk, dtype, base, plain) -> list[dict]:
    backends.launches.clear()
    if device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        values, grads = run_ours(op, backend, inp, options)
        seconds = time.perf_counter() - start
        ran = dict(backends.launches)
        tallies = compare(op, inp, oracle, values, grads, z_of, chunk)
    except Exception as error:  # noqa: BLE001 (recorded and reported as a failure, the run goes on)
        _free()
        return [dict(base, quantity="error", ok=False, error=f"{type(error).__name__}: {error}"[:800])]
    peak = torch.cuda.max_memory_allocated() if device().type == "cuda" else None
    info = dict(seconds_first_call=round(seconds, 4), peak_bytes=peak, launches=ran)
    records = [dict(base, quantity=name, **t.result(dtype, plain.get(name)), **info) for name, t in tallies.items()]
    if not ran.get(backend):
        records.append(dict(base, quantity="launch", ok=False, error=f"backend {backend!r} did not run: {ran}"))
    del values, grads
    _free()
    return records


def _free() -> None:
    if device().type == "cuda":
        torch.cuda.empty_cache()


def _device_name() -> str:
    return torch.cuda.get_device_name() if device().type == "cuda" else "cpu"


def _rtol_names() -> dict:
    return {name: RTOL[dtype] for name, dtype in DTYPES.items()}


def _write(out: Path, header: dict, records: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    failures = sum(not r["ok"] for r in records)
    (out / "parity.json").write_text(json.dumps(dict(header, failures=failures, records=records), indent=1))
    (out / "parity.md").write_text(parity_markdown(header, records))


def default_backends() -> list[str]:
    """On CUDA all three (a missing one fails the run); on the CPU the torch backend (Triton's interpreter would
    take hours at these sizes; the CPU tests cover it)."""
    return ["torch", "triton", "cuda"] if device().type == "cuda" else ["torch"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu" if torch.cuda.is_available() else "smoke")
    parser.add_argument("--backends", default=None, help="comma list (default: torch,triton,cuda on CUDA)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma list of {list(DTYPES)}")
    parser.add_argument("--ops", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    parser.add_argument("--out", type=Path, required=True, help="folder for parity.json and parity.md")
    args = parser.parse_args(argv)
    backend_names = args.backends.split(",") if args.backends else default_backends()
    for name, allowed in ((args.dtypes, DTYPES), (args.ops, CASES)):
        unknown = set(name.split(",")) - set(allowed)
        if unknown:
            parser.error(f"unknown {sorted(unknown)}; choose from {list(allowed)}")
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's and the eager GEMMs in true float32
    return run(args.size, backend_names, args.dtypes.split(","), args.ops.split(","), args.out)


if __name__ == "__main__":
    sys.exit(main())

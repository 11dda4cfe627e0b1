"""Static inspection of every Triton kernel, compiled ahead of time for sm_80 and sm_90a on a machine without a GPU.

    python -m benchmarks.static_report                 # full matrix -> benchmarks/results/static/<triton>.json
    python -m benchmarks.static_report --subset ci --out FILE      # what tests/test_triton_compile.py runs

Per compiled kernel it records registers, spills (ptxas -v), the widths of the global loads in the main loop and the
main loop's SASS instructions per KB of logits (cuobjdump -sass), against the budgets in `BUDGETS`, so that a change
that bloats a loop shows up in review as a diff of the committed JSON.

**Launches are the launchers' own.** Each case in `cases()` calls a real launcher (`token_logprobs_fwd`, ...) on
`meta` tensors (real shapes and strides, no memory) while `JITFunction.run` is patched to record the launch instead of
running it. The recorded arguments go through the JIT's own binder for the target (`create_function_from_signature`
+ `_pack_args`, as `JITFunction.run` does), so the specialisation is exactly a real launch's: ints equal to 1 become
constexpr, ints divisible by 16 and 16-byte aligned pointers get `tt.divisibility=16`, and `num_warps`,
`enable_fp_fusion` and the grid are whatever the launcher chose. Every `*_kernel` JIT function under grpo_kernels
must be reached by some case (`uncovered_kernels`). Each case is launched with 64 and with 16,384 rows, so a launcher
that picks a different grid or kernel for few rows (split-V) is seen with both.

**Instructions per KB** (benchmarks/sass.py). In the SASS, a loop is a backward branch (`BRA` to a lower address); the
main loop is the innermost one whose body holds the most global loads (LDG), i.e. the logits stream (the longest on a
tie, as top-1's loops before and after the target's tile). Its instructions are counted from the branch target to the
branch, inclusive. Each warp issues them once per iteration, while one iteration of the whole program
loads `bytes_per_iteration` = (Σ bytes of the loop's LDGs per thread) × 32 × num_warps — BLOCK_V × element size,
times ptxas's unroll factor, read off the SASS rather than assumed. So

    instructions_per_kb = loop instructions × num_warps × 1024 / bytes_per_iteration

(warp instructions issued per KB of logits streamed: the loop's length where each warp loads 1 KB per iteration).
An H100 at 85% of 3.35 TB/s has about 230-260 issue slots per KB before issue, not bandwidth, is the limit. A kernel
with no such loop (one tile per program) is counted over its whole body instead (`loop: false`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks import sass

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "static"
ARCHS = {"sm_80": 80, "sm_90a": 90}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VOCABS = {"aligned": 151_936, "unaligned": 151_939}  # Qwen2's V; + 3: a row stride that is no multiple of 16 bytes
ROWS = ((1, 64), (8, 2048))  # (B, T): few rows (a launcher may split V) and many
MAX_REGISTERS = 64
# Main-loop warp instructions per KB of logits read, by pass and variant (see the module docstring). The forward
# budget is the Triton kernels' design target; the backward also writes one KB of gradient per KB read, hence twice
# the forward's; soft-capping and the optional statistics (log Σ q², mean, top-1) cost extra math per element and
# get the bandwidth ceiling.
BUDGETS = {
    ("fwd", "base"): 200,
    ("fwd", "softcap"): 260,
    ("fwd", "stats"): 260,
    ("bwd", "base"): 400,
    ("bwd", "softcap"): 520,
}


DIVERGENCES = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}  # the two-head divergence's kernels, by beta


def budget_key(kernel: str, case: str) -> tuple[str, str]:
    """(pass, variant) of a kernel launched by a case: the key into BUDGETS."""
    direction = "bwd" if "_bwd" in kernel else "fwd"
    variant = "softcap" if "softcap" in case else "stats" if "stats" in case else "base"
    return direction, variant


# --- the cases: real launcher calls -------------------------------------------------------------------------------


def _inputs(dtype: torch.dtype, V: int, B: int, T: int) -> dict:
    meta = {"device": "meta"}
    return {
        "logits": torch.empty((B, T, V), dtype=dtype, **meta),  # [B, T, V]
        "targets": torch.empty((B, T), dtype=torch.long, **meta),  # [B, T]
        "mask": torch.empty((B, T), dtype=torch.bool, **meta),  # [B, T]
        "row": torch.empty((B, T), dtype=torch.float32, **meta),  # [B, T]
        "per_sequence": torch.empty((B, 1), dtype=torch.float32, **meta).expand(B, T),  # [B, T], stride 0 in T
    }


def _pass_args(x: dict, **fields):
    """The pass's record (`protocol.VocabPassArgs`) over `_inputs`' logits, targets and mask."""
    from grpo_kernels.kernels.protocol import VocabPassArgs

    return VocabPassArgs(logits=x["logits"], targets=x["targets"], mask=x["mask"], **fields)


def _token_logprobs_fwd(with_entropy: bool, softcap: float | None = None, stats: tuple[str, ...] = ()) -> Callable:
    def launch(dtype, V, B, T):
        from grpo_kernels.kernels.triton import token_logprobs as token_logprobs_triton

        x = _inputs(dtype, V, B, T)
        token_logprobs_triton.token_logprobs_fwd(_pass_args(x, with_entropy=with_entropy, softcap=softcap, stats=stats))

    return launch


def _token_logprobs_bwd(with_entropy: bool, softcap: float | None = None) -> Callable:
    def launch(dtype, V, B, T):
        from grpo_kernels.kernels.protocol import RowGrads
        from grpo_kernels.kernels.triton import token_logprobs as token_logprobs_triton

        x = _inputs(dtype, V, B, T)
        entropy = x["row"] if with_entropy else None
        grads = RowGrads(lse=x["row"], entropy=entropy, grad_logp=x["row"], grad_entropy=entropy)
        args = _pass_args(x, softcap=softcap)
        token_logprobs_triton.token_logprobs_bwd(args, grads, args.logits)  # in place, as the autograd Function does

    return launch


def _grpo_loss_fwd(
    kind: str, with_entropy: bool = False, softcap: float | None = None, is_ratio: bool = False, **epilogue
) -> Callable:
    def launch(dtype, V, B, T):
        from grpo_kernels.kernels.protocol import LossSides
        from grpo_kernels.kernels.triton import grpo_loss as grpo_loss_triton
        from grpo_kernels.losses.epilogue import TokenEpilogue
        from grpo_kernels.options import LossOptions

        x = _inputs(dtype, V, B, T)
        spec = dataclasses.replace(TokenEpilogue.from_options(LossOptions()), kind=kind, **epilogue)
        sides = LossSides(
            weights=x["row"], advantages=x["per_sequence"], old_logp=x["row"], ref_logp=x["row"] if spec.beta else None,
            is_ratio=x["per_sequence"] if is_ratio else None,
        )  # fmt: skip
        grpo_loss_triton.grpo_loss_fwd(_pass_args(x, with_entropy=with_entropy, softcap=softcap), sides, spec)

    return launch


def _divergence_chunk(beta: float, with_grad: bool = True, top_k: int = 0, token_loss: str = "") -> Callable:
    """The two-head divergence's chunk pass (with top_k: the top-k-plus-tail one, the teacher's top k): it reads the
    driver's float32 logits buffers whatever the heads' dtype. `token_loss` ("logp", or "entropy": with dL/dentropy
    too): a token loss sharing its sweeps (the statistics launch, then the gradient kernel)."""

    def launch(dtype, V, B, T):
        from grpo_kernels.kernels.torch.divergence import ChunkSpec, Head, TokenGradient
        from grpo_kernels.kernels.triton import divergence as divergence_triton
        from grpo_kernels.kernels.triton import divergence_topk

        logits = torch.empty((B * T, V), dtype=torch.float32, device="meta")  # [c, V], each head's
        chunk = (logits, torch.empty_like(logits), _inputs(dtype, V, B, T)["targets"].view(-1))
        spec = ChunkSpec(beta, teacher=Head(final_logit_softcapping=30.0), with_grad=with_grad)
        if top_k:
            divergence_topk.topk_divergence_chunk(*chunk, spec, k=top_k, ids=None)
        elif token_loss:

            def gradients(logp, entropy):
                grad_entropy = torch.empty_like(entropy) if token_loss == "entropy" else None
                return TokenGradient(chunk[2], torch.empty_like(logp), grad_entropy)

            divergence_triton.divergence_chunk(*chunk, spec, token_loss=gradients)
        else:
            divergence_triton.divergence_chunk(*chunk, spec)

    return launch


def cases() -> dict[str, Callable]:
    """Case name -> launch(dtype, V, B, T); each policy epilogue and KL estimator of the fused kernel is one case."""
    from grpo_kernels.kernels.protocol import TOKEN_STATS
    from grpo_kernels.kernels.triton.grpo_loss import EPILOGUES, KL_KINDS

    out = {
        "token_logprobs_fwd": _token_logprobs_fwd(False),
        "token_logprobs_fwd[entropy]": _token_logprobs_fwd(True),
        "token_logprobs_fwd[entropy,softcap]": _token_logprobs_fwd(True, softcap=30.0),
        "token_logprobs_fwd[entropy,stats]": _token_logprobs_fwd(True, stats=TOKEN_STATS),
        "token_logprobs_bwd": _token_logprobs_bwd(False),
        "token_logprobs_bwd[entropy]": _token_logprobs_bwd(True),
        "token_logprobs_bwd[entropy,softcap]": _token_logprobs_bwd(True, softcap=30.0),
        "grpo_loss_fwd[clip,entropy]": _grpo_loss_fwd("clip", with_entropy=True),
        "grpo_loss_fwd[clip,entropy,softcap]": _grpo_loss_fwd("clip", with_entropy=True, softcap=30.0),
        "grpo_loss_fwd[clip,delta,dual_clip,is,bias_correction]": _grpo_loss_fwd(
            "clip", delta=1.5, clip_ratio_c=3.0, is_ratio=True, beta=0.04, bias_correction=True
        ),
        "grpo_loss_fwd[cispo,two_sided]": _grpo_loss_fwd("cispo", cispo_two_sided=True),
    }
    out["divergence_chunk[jsd]"] = _divergence_chunk(DIVERGENCES["jsd"])  # the others: benchmarks/launch_space.py
    out["topk_divergence_chunk[jsd]"] = _divergence_chunk(DIVERGENCES["jsd"], top_k=32)
    out["divergence_chunk[jsd,token_loss]"] = _divergence_chunk(DIVERGENCES["jsd"], token_loss="entropy")
    for kind in EPILOGUES:
        out[f"grpo_loss_fwd[{kind}]"] = _grpo_loss_fwd(kind)
    for kl in KL_KINDS:
        out[f"grpo_loss_fwd[clip,kl={kl}]"] = _grpo_loss_fwd("clip", beta=0.04, kl_estimator=kl)
    return out


def matrix(subset: str) -> list[tuple[str, str, str, str]]:
    """(arch, case, dtype, vocab) to compile. `full`: everything. `ci`: per arch, the forward and backward with
    entropy (and the fused clip loss) at every dtype and both vocabularies, and every other case at bf16, aligned V."""
    names = list(cases())
    full = [(a, c, d, v) for a in ARCHS for c in names for d in DTYPES for v in VOCABS]
    if subset == "full":
        return full
    core = {"token_logprobs_fwd[entropy]", "token_logprobs_bwd[entropy]", "grpo_loss_fwd[clip,entropy]"}
    return [(a, c, d, v) for a, c, d, v in full if c in core or (d == "bf16" and v == "aligned")]


def missing_tools() -> list[str]:
    """The NVIDIA tools the inspection needs (bundled with triton) that cannot be found: ptxas (sm_80),
    ptxas-blackwell (sm_90a in triton 3.9), cuobjdump."""
    from triton import knobs

    missing = []
    for name in ("ptxas", "ptxas_blackwell", "cuobjdump"):
        try:
            tool = getattr(knobs.nvidia, name)
        except Exception:  # an unknown knob (another triton) or a tool that does not run
            tool = None
        if tool is None or not os.access(tool.path, os.X_OK):
            missing.append(name.replace("_", "-"))
    return missing


# --- recording launches and compiling them --------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict
    grid: object


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Patch JITFunction.run so that `kernel[grid](...)` records its launch and runs nothing."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, grid))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def launches_of(case: str, dtype: str, vocab: str) -> list[Launch]:
    launch = cases()[case]
    with recorded_launches() as recorded:
        for B, T in ROWS:
            launch(DTYPES[dtype], VOCABS[vocab], B, T)
    return recorded


def jit_kernels() -> dict[str, object]:
    """Every `*_kernel` JITFunction in the grpo_kernels modules that use @triton.jit, by name."""
    from triton.runtime.jit import JITFunction

    found = {}
    for path in sorted((ROOT / "grpo_kernels").rglob("*.py")):
        if "@triton.jit" in path.read_text():
            module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
            for name, value in vars(module).items():
                if isinstance(value, JITFunction) and name.endswith("_kernel"):
                    found[name] = value
    return found


def uncovered_kernels() -> list[str]:
    reached = {launch.kernel.__name__ for c in cases() for launch in launches_of(c, "bf16", "aligned")}
    reached |= {launch.kernel.__name__ for c in cases() for launch in launches_of(c, "bf16", "unaligned")}
    return sorted(set(jit_kernels()) - reached)


def specialise(launch: Launch, capability: int) -> tuple:
    """(signature, constexprs, attrs, options) of a recorded launch for `capability`, as JITFunction.run binds it."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, kwargs = launch.kernel, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug  # as JITFunction.run
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # the second from triton 3.9
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def compile_launch(launch: Launch, capability: int):
    """Compile a recorded launch for `capability` as JITFunction.run would on such a GPU: (kernel, ptxas log,
    constexprs)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialise(launch, capability)
    target, fn = GPUTarget("cuda", capability, 32), launch.kernel
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # the cache is fresh (main), so ptxas runs and prints its -v report
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return kernel, log.getvalue(), constexprs


_MEASURED: dict[str, dict] = {}  # kernel hash -> its ptxas and SASS numbers (benchmarks.sass), in this process


def inspect(arch: str, case: str, dtype: str, vocab: str) -> list[dict]:
    """One row per distinct kernel the case launches, compiled for `arch`."""
    rows, seen = [], set()
    for launch in launches_of(case, dtype, vocab):
        kernel, log, constexprs = compile_launch(launch, ARCHS[arch])
        if kernel.hash in seen:
            continue
        seen.add(kernel.hash)
        name = launch.kernel.__name__
        reads_logits = "logits_ptr" in launch.kernel.arg_names
        if kernel.hash not in _MEASURED:  # else a cache hit, which ran no ptxas
            _MEASURED[kernel.hash] = sass.measure(kernel, log, reads_logits)
        row = {"arch": arch, "kernel": name, "case": case, "dtype": dtype, "V": VOCABS[vocab], "vocab": vocab}
        row["grid"] = list(launch.grid) if isinstance(launch.grid, tuple) else str(launch.grid)
        row |= {"num_warps": kernel.metadata.num_warps, "enable_fp_fusion": kernel.metadata.enable_fp_fusion}
        row["constexprs"] = {launch.kernel.arg_names[path[0]]: _plain(v) for path, v in constexprs.items()}
        row |= {"reads_logits": reads_logits, **_MEASURED[kernel.hash]}
        if reads_logits:
            row["budget"] = BUDGETS.get(budget_key(name, case))
        rows.append(row)
    return rows


def _plain(value):
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


# --- running the matrix ---------------------------------------------------------------------------------------------


def _worker(job: tuple[str, str, str, str]) -> list[dict]:
    return inspect(*job)


def _init_worker(cache_root: str) -> None:
    # before triton is imported in this process: its own fresh cache, so that ptxas runs (and reports) on first sight
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(dir=cache_root)


def run(
    subset: str | list,
    jobs: int,
    archs: tuple[str, ...] = tuple(ARCHS),
    worker: Callable = _worker,
    item_arch: Callable = lambda item: item[0],
) -> list[dict]:
    """`worker(item)` rows for each (arch, case, dtype, vocab) item of the subset (or each item of a list, whose arch
    `item_arch` gives) on `archs`, in `jobs` fresh processes."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the JIT functions that are compiled here")
    items = [item for item in (matrix(subset) if isinstance(subset, str) else subset) if item_arch(item) in archs]
    with tempfile.TemporaryDirectory(prefix="triton-static-") as cache:
        spawn = multiprocessing.get_context("spawn")  # each worker imports triton after _init_worker
        with ProcessPoolExecutor(jobs, mp_context=spawn, initializer=_init_worker, initargs=(cache,)) as pool:
            rows = [row for part in pool.map(worker, items) for row in part]
    return sorted(rows, key=lambda r: (r["arch"], r["kernel"], r["case"], r["dtype"], r["vocab"]))


def report(subset: str, jobs: int) -> dict:
    import triton

    return {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "command": f"python -m benchmarks.static_report --subset {subset}",
        "subset": subset,
        "max_registers": MAX_REGISTERS,
        "budgets_instructions_per_kb": {f"{d}/{v}": b for (d, v), b in BUDGETS.items()},
        "uncovered_kernels": uncovered_kernels(),
        "kernels": run(subset, jobs),
    }


def shortfalls(rows: list[dict]) -> dict[tuple[str, str], str]:
    """What each (check, "arch/case/dtype/vocab") misses, with the measured numbers: the strict xfails of
    tests/test_triton_compile.py (its SHORTFALLS) for these rows."""
    out: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        key, name = f"{r['arch']}/{r['case']}/{r['dtype']}/{r['vocab']}", r["kernel"]
        if r["spill_store_bytes"] or r["spill_load_bytes"]:
            out.setdefault(("spills", key), []).append(f"{name}: {r['spill_store_bytes']} B spill stores")
        if r["registers"] > MAX_REGISTERS:
            out.setdefault(("registers", key), []).append(f"{name}: {r['registers']} registers")
        if r["reads_logits"] and set(r["loop_ldg_bits"]) != {128}:
            widths = ", ".join(f"{r['loop_ldg_bits'].count(b)}x{b}" for b in sorted(set(r["loop_ldg_bits"])))
            out.setdefault(("vector_loads", key), []).append(f"{name}: main-loop LDG bits {widths}")
        if r["reads_logits"] and (r["budget"] is None or r["instructions_per_kb"] > r["budget"]):
            measured = f"{name}: {r['instructions_per_kb']} instructions/KB > {r['budget']}"
            out.setdefault(("budget", key), []).append(measured)
    return {key: "; ".join(sorted(set(why))) for key, why in sorted(out.items())}


def dumps(result: dict) -> str:
    """JSON with one line per kernel, so that a review diff names each kernel whose numbers moved."""
    head = json.dumps({k: v for k, v in result.items() if k != "kernels"}, indent=1)
    rows = ",\n".join(f"  {json.dumps(row)}" for row in result["kernels"])
    return f'{head[:-2]},\n "kernels": [\n{rows}\n ]\n}}\n'


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", choices=("full", "ci"), default="full")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/static/<triton version>.json")
    parser.add_argument("--shortfalls", action="store_true", help="also print the failed checks as SHORTFALLS entries")
    args = parser.parse_args(argv)
    result = report(args.subset, args.jobs)
    out = args.out or RESULTS / f"{result['triton']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result))
    print(f"{len(result['kernels'])} kernels -> {out}", file=sys.stderr)
    if args.shortfalls:
        entries = [f"    {key!r}: {why!r}," for key, why in shortfalls(result["kernels"]).items()]
        print("SHORTFALLS = {", *entries, "}", sep="\n")


if __name__ == "__main__":
    main()

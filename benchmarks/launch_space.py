"""Every configuration of the Triton launchers that the public API can reach, enumerated from the options themselves.

A launch's compiled code depends on its constexprs, its dtype and the alignment of its row stride. The options that
shape the vocabulary pass (entropy, soft-capping, each subset of `function.TOKEN_STATS`) change its loops and
reductions: each subset of the statistics and each combination of entropy and soft-capping is taken, at every dtype.
The fused loss's epilogue options (`EPILOGUES`, `KL_KINDS` and the flags of `TokenEpilogue`: δ, dual clip, two-sided
CISPO, an importance ratio, bias-corrected KL) are float32 arithmetic on each row after the pass: each value is taken
once, at bf16, over the pass with entropy. tests/test_triton_compile.py compiles all of them for sm_90a on each
supported triton (benchmarks/older_triton.py): 3 dtypes × (8 subsets of the statistics, 7 more forward, 4 backward
and 4 fused-loss configurations), and 11 epilogues; a launch whose specialisation another had is compiled once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from benchmarks import static_report

SOFTCAP = 30.0


def _subsets(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [c for r in range(len(names) + 1) for c in itertools.combinations(names, r)]


def _name(op: str, flags: list[str]) -> str:
    return f"{op}[{','.join(flags)}]" if flags else op


def _epilogues() -> dict[str, dict]:
    """Epilogue name -> `static_report._grpo_loss_fwd` keywords: each policy kind, each KL estimator, each flag."""
    from grpo_kernels.kernels.triton.grpo_loss import EPILOGUES, KL_KINDS

    out = {kind: {"kind": kind} for kind in EPILOGUES}
    out |= {f"clip,kl={kl}": {"kind": "clip", "beta": 0.04, "kl_estimator": kl} for kl in KL_KINDS}
    out["clip,delta"] = {"kind": "clip", "delta": 1.5}
    out["clip,dual_clip"] = {"kind": "clip", "clip_ratio_c": 3.0}
    out["clip,is"] = {"kind": "clip", "is_ratio": True}
    out["clip,kl=k3,bias_correction"] = {"kind": "clip", "beta": 0.04, "kl_estimator": "k3", "bias_correction": True}
    out["cispo,two_sided"] = {"kind": "cispo", "cispo_two_sided": True}
    return out


def reachable_cases() -> dict[str, Callable]:
    """Case name -> launch(dtype, V, B, T), as `static_report.cases()`: the forward with each subset of the statistics
    (with entropy), each combination of entropy and soft-capping in the forward (with every statistic and without) and
    the backward, the fused loss with each epilogue (with entropy) and each combination of entropy and soft-capping
    (clip), and the two-head divergence's chunk passes (whole vocabulary, top-k plus tail) for each divergence, with and
    without the gradient, and with a token loss sharing its sweeps (with and without dL/dentropy)."""
    from grpo_kernels.kernels.protocol import TOKEN_STATS

    out = {}
    for stats in _subsets(TOKEN_STATS):
        name = _name("token_logprobs_fwd", ["entropy"] + [f"stats={'+'.join(stats)}"] * bool(stats))
        out[name] = static_report._token_logprobs_fwd(True, stats=stats)
    for with_entropy, softcap in itertools.product((False, True), (None, SOFTCAP)):
        flags = ["entropy"] * with_entropy + ["softcap"] * (softcap is not None)
        for stats in ((), TOKEN_STATS) if (with_entropy, softcap) != (True, None) else ():  # those: above
            name = _name("token_logprobs_fwd", flags + ["stats=all"] * bool(stats))
            out[name] = static_report._token_logprobs_fwd(with_entropy, softcap=softcap, stats=stats)
        out[_name("token_logprobs_bwd", flags)] = static_report._token_logprobs_bwd(with_entropy, softcap=softcap)
        launch = static_report._grpo_loss_fwd("clip", with_entropy=with_entropy, softcap=softcap)
        out[_name("grpo_loss_fwd", ["clip", *flags])] = launch
    for kind, beta in static_report.DIVERGENCES.items():
        for with_grad in (False, True):  # soft-capping and targets are run-time flags: the same code
            launch = static_report._divergence_chunk(beta, with_grad)
            out[_name("divergence_chunk", [kind] + ["grad"] * with_grad)] = launch
            launch = static_report._divergence_chunk(beta, with_grad, top_k=32)
            out[_name("topk_divergence_chunk", [kind] + ["grad"] * with_grad)] = launch
        for token_loss in ("logp", "entropy"):  # a token loss sharing the sweeps: the gradient kernel's u term or not
            launch = static_report._divergence_chunk(beta, token_loss=token_loss)
            out[_name("divergence_chunk", [kind, "grad", f"token_loss={token_loss}"])] = launch
    for epilogue, keywords in _epilogues().items():
        keywords = dict(keywords)
        launch = static_report._grpo_loss_fwd(keywords.pop("kind"), with_entropy=True, **keywords)
        out[_name("grpo_loss_fwd", [epilogue, "entropy"])] = launch
    return out


def matrix(archs: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    """(arch, case, dtype, vocab): every reachable configuration above at every dtype (V = 151,936), but the fused
    loss's epilogues at bf16 only (they see float32 row values, whatever the logits' dtype; the pass under them is
    crossed with every dtype in `grpo_loss_fwd[clip,...]`), and the `ci` subset of benchmarks/static_report.py, which
    adds the row stride that is no multiple of 16 bytes (V = 151,939)."""
    out = []
    for arch, case in itertools.product(archs, reachable_cases()):
        epilogue = case.startswith("grpo_loss_fwd[") and not case.startswith("grpo_loss_fwd[clip,entropy")
        epilogue = epilogue and case not in ("grpo_loss_fwd[clip]", "grpo_loss_fwd[clip,softcap]")
        epilogue = epilogue or "divergence_chunk[" in case  # float32 buffers whatever the heads' dtype
        out += [(arch, case, dtype, "aligned") for dtype in (["bf16"] if epilogue else static_report.DTYPES)]
    return out + [item for item in static_report.matrix("ci") if item[0] in archs]


def launches_of(case: str, dtype: str, vocab: str) -> list[static_report.Launch]:
    """The recorded launches of a case of `reachable_cases()` or of `static_report.cases()`."""
    launch = reachable_cases().get(case) or static_report.cases()[case]
    with static_report.recorded_launches() as recorded:
        for B, T in static_report.ROWS:
            launch(static_report.DTYPES[dtype], static_report.VOCABS[vocab], B, T)
    return recorded

"""The CUDA backend without a GPU: every csrc/*.cu compiles (nvcc -c for sm_80 and sm_90; where
tests/test_check_build.py built the extension earlier in the session, its objects show it), and the kernels'
host-device arithmetic (the logit transform, online log-sum-exp and its merge, the logit gradient with the
transform's chain rule, the token-loss epilogue; common.cuh), with and without the entropy (the kernels' kEntropy
template parameter), run on the CPU through csrc/tests/epilogue_test.cpp (g++) matches the float64 oracle. On the
device the per-element exponentials and the soft-cap's division are the fast intrinsics (common.cuh fast_exp:
__expf, within 2 + 1.17|x| ulp; fast_div: __fdividef), here the accurate expf and division: this checks the formulas,
not the intrinsics' few-ulp error. Each part skips, with the reason, where its compiler is
absent. Nothing here launches a kernel: that needs a GPU and grpo_kernels._C.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from grpo_kernels import reference
from grpo_kernels.kernels.cuda import launchers as cuda
from grpo_kernels.kernels.triton.grpo_loss import EPILOGUES, KL_KINDS
from grpo_kernels.losses.epilogue import TokenEpilogue
from grpo_kernels.losses.loss import per_token_loss
from grpo_kernels.losses.terms import build_terms
from grpo_kernels.options import LossOptions
from tests import extension_build
from tests.conftest import assert_close

CSRC = Path(__file__).resolve().parent.parent / "csrc"
CU_SOURCES = sorted(CSRC.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")
# torch's CUDAExtension compiles with these, so a .cu that leans on implicit half/bfloat16 conversions fails here too
TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
)


def test_cuda_sources_include_no_pytorch_header():
    assert CU_SOURCES, f"no .cu file under {CSRC}"
    for path in [*CU_SOURCES, *CSRC.glob("*.cuh"), CSRC / "kernels.h"]:
        for line in path.read_text().splitlines():
            if line.startswith("#include"):
                assert not any(h in line for h in ("<torch/", "<ATen/", "<c10/")), f"{path.name}: {line}"


@pytest.fixture(scope="module")
def nvcc_builds(tmp_path_factory) -> dict[tuple[str, str], tuple[int, str, list[str]]]:
    """Every (source, arch) compiled: (source, arch) -> (exit code, output, command). A pair that this session's
    csrc/check_build.sh run (tests/test_check_build.py, earlier) already compiled, as setup.py does with torch's nvcc
    flags, is read off its object (SASS for that arch, listed by cuobjdump); the others are compiled here at once,
    in parallel."""
    built = {source.name: extension_build.compiled_archs(source) for source in CU_SOURCES}
    out, done, running = tmp_path_factory.mktemp("nvcc"), {}, {}
    for source in CU_SOURCES:
        for arch in ARCHS:
            if built[source.name] is not None and arch in built[source.name][1]:
                obj = built[source.name][0]
                done[source.name, arch] = (0, f"{obj} holds {arch} SASS", ["csrc/check_build.sh", "->", str(obj)])
                continue
            nvcc = shutil.which("nvcc")
            if nvcc is None:
                pytest.skip("nvcc is not on PATH: the CUDA sources cannot be compiled on this machine")
            command = [nvcc, "-c", f"-arch={arch}", "-std=c++17", "-O2", *TORCH_NVCC_DEFINES, str(source)]
            command += ["-o", str(out / f"{source.stem}.{arch}.o")]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running[source.name, arch] = (process, command)
    return done | {key: (p.wait(timeout=600), p.stdout.read(), command) for key, (p, command) in running.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", [p.name for p in CU_SOURCES])
def test_cuda_source_compiles(nvcc_builds, source, arch):
    code, output, command = nvcc_builds[source, arch]
    assert code == 0, f"{' '.join(command)}\n{output}"


# --- the host-device arithmetic on the CPU ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def host_test(tmp_path_factory):
    """The compiled csrc/tests/epilogue_test.cpp: a function running it on some input lines, returning its lines."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not on PATH: the host-device functions cannot be run on the CPU here")
    binary = tmp_path_factory.mktemp("host") / "epilogue_test"
    command = [compiler, "-std=c++17", "-O1", "-DGRPO_KERNELS_HOST_TEST", f"-I{CSRC}"]
    command += [str(CSRC / "tests" / "epilogue_test.cpp"), "-o", str(binary)]
    build = subprocess.run(command, capture_output=True, text=True)
    assert build.returncode == 0, f"{' '.join(command)}\n{build.stderr}"

    def run(lines: list[str]) -> list[list[str]]:
        done = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return [line.split() for line in done.stdout.splitlines()]

    return run


def _f32(x: float) -> float:
    """x rounded to float32: the C++ side reads float32, so both sides see the same numbers."""
    return float(torch.tensor(x, dtype=torch.float32))


def _floats(words: list[str]) -> torch.Tensor:
    return torch.tensor([float(w) for w in words], dtype=torch.float64)


def _row(V: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * scale).to(torch.float32)


EXTREME = _row(33, 6, scale=1e4)
ROWS = {  # name -> (logits [V] float32, temperature, target, head (elements before the first 16-byte boundary))
    "aligned": (_row(64, 0), 1.0, 5, 0),
    "ragged_misaligned": (_row(37, 1), 1.0, 36, 3),
    "single": (_row(1, 2), 1.0, 0, 0),
    "head_only": (_row(3, 3), 1.0, 1, 7),
    "temperature": (_row(50, 4), 0.7, 0, 2),
    "neg_inf_logits": (_row(41, 5).index_fill(0, torch.tensor([0, 7, 40]), -math.inf), 1.0, 3, 1),
    "extreme_logits": (EXTREME, 1.0, int(EXTREME.argmax()), 2),  # a sampled token is a probable one
    "all_equal": (torch.full((29,), 2.5), 1.3, 28, 5),
}


TRANSFORMS = {  # name -> (logit_scale, final_logit_softcapping)
    "plain": (1.0, None),
    "scaled": (0.25, None),
    "softcapped": (1.0, 5.0),  # tanh far from linear: |logits| ~ 3 against a cap of 5
    "scaled_softcapped": (2.0, 3.0),
}


def _transformed(logits: torch.Tensor, temperature: float, logit_scale: float, softcap: float | None):
    """The float64 logits the softmax sees: s·x, then c·tanh(·/c), then /T."""
    z = logits.double() * logit_scale
    return (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", ROWS)
def test_online_lse_and_logit_gradient_match_oracle(host_test, name, transform):
    """lse, logp, entropy of a row split over lanes as a kernel splits it, and d(g·logp + g_H·H)/dx, for raw
    logits x under each logit transform (scale, soft-cap, temperature)."""
    logits, temperature, target, head = ROWS[name]
    logit_scale, softcap = TRANSFORMS[transform]
    g, g_h = 0.75, -0.4
    temperature = _f32(temperature)
    numbers = f"{temperature!r} {logit_scale!r} {0.0 if softcap is None else softcap!r}"
    line = f"row {logits.numel()} {numbers} {target} {g} {g_h} {head} " + " ".join(map(repr, logits.tolist()))
    [[kind, *values]] = host_test([line])
    assert kind == "row"
    V = logits.numel()
    lse, logp, entropy, lse_plain = _floats(values[:4])
    grad, grad_plain = _floats(values[4 : 4 + V]), _floats(values[4 + V :])
    assert lse_plain == lse, "the pass without the entropy (kEntropy = false) folds the same max and sum"

    x = logits.double().requires_grad_()
    transform_args = dict(temperature=temperature, logit_scale=logit_scale, final_logit_softcapping=softcap)
    ref_logp, ref_entropy = reference.token_logprobs(x[None], torch.tensor([target]), **transform_args)
    (ref_grad,) = torch.autograd.grad(g * ref_logp.sum() + g_h * ref_entropy.sum(), x, retain_graph=True)
    (ref_grad_plain,) = torch.autograd.grad(g * ref_logp.sum(), x)
    ref_lse = torch.logsumexp(_transformed(x.detach(), temperature, logit_scale, softcap), dim=0)
    label = f"{name}/{transform}"
    assert_close(lse, ref_lse, torch.float32, f"{label}: lse")
    assert_close(logp, ref_logp.detach()[0], torch.float32, f"{label}: logp")
    assert_close(entropy, ref_entropy.detach()[0], torch.float32, f"{label}: entropy")
    assert_close(grad, ref_grad, torch.float32, f"{label}: dL/dlogits")
    assert_close(grad_plain, ref_grad_plain, torch.float32, f"{label}: dL/dlogits of logp alone")


POLICY_OPTIONS = {  # the token-level loss types of the fused epilogue, with their hyperparameters
    "grpo": dict(loss_type="grpo"),
    "grpo_dual_clip": dict(loss_type="grpo", clip_ratio_c=3.0),
    "dapo_delta_dual_clip": dict(loss_type="dapo", epsilon_high=0.28, delta=1.5, clip_ratio_c=3.0),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "cispo_two_sided": dict(loss_type="cispo", epsilon_high=0.28, cispo_two_sided=True),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
    "gpg": dict(loss_type="gpg"),
}
KL_OPTIONS = {"no_kl": dict(beta=0.0)} | {
    f"{kl}{'_bias_corrected' if bias else ''}": dict(beta=0.04, kl_estimator=kl, use_bias_correction_kl=bias)
    for kl in ("k1", "k2", "k3", "low_var_kl")
    for bias in (False, True)
}
TOKENS = {  # name -> (logp, old_logp or None, ref_logp, advantage, is_ratio or None, weight)
    "inside_clip": (-1.2, -1.25, -1.0, 0.8, None, 1.0),
    "above_clip": (-0.5, -1.5, -0.7, 1.1, 0.7, 0.25),
    "below_clip_negative_a": (-3.0, -1.0, -2.5, -0.9, None, 0.5),
    "dual_clip_floor": (-0.2, -2.0, -0.3, -0.5, 1.3, 1.0),
    "on_policy_tie": (-2.0, None, -2.2, 0.6, None, 1.0),
    "log_ratio_clamped": (-0.1, -25.0, -0.05, 0.3, None, 1.0),
    "kl_clamped": (-1.0, -1.1, -30.0, -0.4, None, 2.0),
    "low_var_kl_clamped": (-1.0, -0.9, -16.0, 0.7, None, 1.0),
    "kl_series": (-1.19, -1.2, -1.2, 0.5, 0.9, 1.0),
    "zero_advantage": (-0.8, -0.9, -0.7, 0.0, None, 1.0),
}


def _oracle_token_loss(options: LossOptions, logp, old, ref, adv, is_ratio, weight) -> tuple[float, float]:
    """losses/ (the specification) on one token, float64: its weighted loss and d loss / d logp by autograd."""
    t = lambda x: None if x is None else torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    logp_t = t(logp).requires_grad_()
    mask = torch.ones(1, 1, dtype=torch.float64)
    terms = build_terms(
        logp_t,
        old_logp=t(old),
        ref_logp=t(ref),
        advantages=t(adv),
        mask=mask,
        is_ratio=t(is_ratio),
        options=options,
        token_weights=t(weight),
    )
    loss = per_token_loss(terms, options).sum()
    (dlogp,) = torch.autograd.grad(loss, logp_t)
    return loss.item(), dlogp.item()


def _loss_line(e: TokenEpilogue, logp, old, ref, adv, is_ratio, weight) -> str:
    """The epilogue_test input line of one token under epilogue `e` (see csrc/tests/epilogue_test.cpp)."""
    numbers = [
        *(EPILOGUES[e.kind], KL_KINDS[e.kl_estimator], int(e.beta != 0.0), e.beta, e.eps_low, e.eps_high),
        *(int(e.delta is not None), 1.0 if e.delta is None else e.delta),
        *(int(e.clip_ratio_c is not None), 1.0 if e.clip_ratio_c is None else e.clip_ratio_c),
        *(int(e.cispo_two_sided), int(e.bias_correction), e.tau_pos, e.tau_neg, logp, adv),
        *(int(old is not None), 0.0 if old is None else old, ref, 1.0 if is_ratio is None else is_ratio, weight),
    ]
    return "loss " + " ".join(repr(_f32(x)) if isinstance(x, float) else str(x) for x in numbers)


def test_token_loss_epilogue_matches_losses(host_test):
    """Every fused policy × KL estimator (± bias correction) × token regime, against losses/ in float64."""
    cases, lines = [], []
    for policy_name, policy in POLICY_OPTIONS.items():
        for kl_name, kl in KL_OPTIONS.items():
            options = LossOptions(**policy, **kl)
            epilogue = TokenEpilogue.from_options(options)
            for token_name, token in TOKENS.items():
                token = tuple(None if v is None else _f32(v) for v in token)
                lines.append(_loss_line(epilogue, *token))
                cases.append((f"{policy_name}/{kl_name}/{token_name}", options, token))
    for (name, options, token), (kind, *values) in zip(cases, host_test(lines), strict=True):
        assert kind == "loss"
        expected = torch.tensor(_oracle_token_loss(options, *token), dtype=torch.float64)
        assert_close(_floats(values), expected, torch.float32, f"{name}: (loss, dlogp)")


# --- without the extension ----------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("grpo_kernels._C") is not None, reason="grpo_kernels._C is built here")
def test_missing_extension_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"grpo_kernels\._C.*GRPO_KERNELS_BUILD_CUDA=1 pip install"):
        cuda.ops()
    usable, why = cuda.cuda_usable(torch.device("cpu"))
    assert not usable and "grpo_kernels._C" in why

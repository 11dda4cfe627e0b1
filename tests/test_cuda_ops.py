"""`torch.library.opcheck` on every custom op of the CUDA extension (grpo_kernels._C): schema (what each op mutates:
the out-of-place backward only `out`, the in-place one the logits), fake/meta kernels, and AOT dispatch, as
`torch.compile` relies on them. Needs a CUDA GPU and the built extension (`GRPO_KERNELS_BUILD_CUDA=1 pip install
--no-build-isolation .`); skipped with the reason otherwise. And `backend="auto"` stays Triton on CUDA."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.protocol import RowGrads, VocabPassArgs
from grpo_kernels.losses.epilogue import TokenEpilogue
from grpo_kernels.options import LossOptions

# the extension's tests: cuda-marked, skipped with the reason where there is no GPU or no extension
NO_EXTENSION = (
    "needs a CUDA GPU" if not torch.cuda.is_available()
    else "grpo_kernels._C is not built (setup.py)" if importlib.util.find_spec("grpo_kernels._C") is None
    else None
)  # fmt: skip
extension = pytest.mark.skipif(NO_EXTENSION is not None, reason=str(NO_EXTENSION))
B, T, V = 2, 5, 300
OPS = ("token_logprobs_fwd", "token_logprobs_bwd", "token_logprobs_bwd_inplace", "grpo_loss_fwd")


def _inputs(dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = dict(
        logits=torch.randn(B, T, V, generator=g, device="cuda").to(dtype),
        targets=torch.randint(0, V, (B, T), generator=g, device="cuda"),
        mask=torch.rand(B, T, generator=g, device="cuda") > 0.2,
    )
    x["lse"] = torch.logsumexp(x["logits"].float(), -1)  # [B, T]
    x["entropy"] = torch.rand(B, T, device="cuda")
    x["grad"] = torch.randn(B, T, generator=g, device="cuda")
    return x


def _cases(name: str, x: dict) -> list[tuple]:
    """(args) of `name` at this input: softcapped or not, with and without the entropy."""
    cases = []
    for softcap in (None, 30.0):
        for entropy in (False, True):
            ent = x["entropy"] if entropy else None
            grads = (x["grad"], x["grad"] if entropy else None)
            rows = (x["targets"], x["mask"])
            if name == "token_logprobs_fwd":
                cases.append((x["logits"], *rows, 1.0, entropy, 1.0, softcap))
            elif name == "token_logprobs_bwd":
                out = torch.empty_like(x["logits"])
                cases.append((x["logits"], *rows, x["lse"], ent, *grads, 0.9, 1.0, softcap, out))
            elif name == "token_logprobs_bwd_inplace":
                cases.append((x["logits"].clone(), *rows, x["lse"], ent, *grads, 0.9, 1.0, softcap))
            else:
                spec = TokenEpilogue.from_options("clip", LossOptions(beta=0.04))
                weights, adv = torch.ones(B, T, device="cuda"), torch.randn(B, 1, device="cuda").expand(B, T)
                old = -torch.rand(B, T, device="cuda") - 3.0
                cases.append(
                    (x["logits"], *rows, weights, adv, old, old + 0.05, None, spec.kind, spec.eps_low, spec.eps_high,
                     spec.delta, spec.clip_ratio_c, spec.cispo_two_sided, spec.beta, spec.kl_estimator,
                     spec.bias_correction, spec.tau_pos, spec.tau_neg, 1.0, entropy, 1.0, softcap)
                )  # fmt: skip
    return cases


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.cuda
@extension
def test_opcheck(name, dtype):
    from grpo_kernels.kernels.cuda import launchers as cuda

    op = getattr(cuda.ops(), name)
    for args in _cases(name, _inputs(dtype)):
        torch.library.opcheck(op, args)


@pytest.mark.cuda
@extension
def test_inplace_backward_declares_the_logits_mutated():
    from grpo_kernels.kernels.cuda import launchers as cuda

    schemas = {name: getattr(cuda.ops(), name).default._schema for name in OPS}
    mutated = {n: [a.name for a in s.arguments if a.alias_info and a.alias_info.is_write] for n, s in schemas.items()}
    assert mutated == dict(
        token_logprobs_fwd=[], token_logprobs_bwd=["out"], token_logprobs_bwd_inplace=["logits"], grpo_loss_fwd=[]
    )


@pytest.mark.cuda
@extension
def test_inplace_backward_writes_what_the_out_of_place_one_writes():
    from grpo_kernels.kernels.cuda import launchers as cuda

    x = _inputs(torch.float32)
    args = VocabPassArgs(logits=x["logits"], targets=x["targets"], mask=x["mask"])
    grads = RowGrads(lse=x["lse"], grad_logp=x["grad"])
    out = torch.empty_like(x["logits"])
    cuda.token_logprobs_bwd(args, grads, out)
    logits = x["logits"].clone()
    cuda.token_logprobs_bwd(dataclasses.replace(args, logits=logits), grads, logits)
    torch.testing.assert_close(logits, out, rtol=0, atol=0)


def test_auto_keeps_triton_on_cuda(monkeypatch):
    """backend="auto" on CUDA tensors is Triton, also where the CUDA extension is built."""
    monkeypatch.setattr(backends.cuda.launchers, "cuda_usable", lambda device: (True, ""))
    assert backends.resolve_backend("auto", torch.device("cuda")) == "triton"


def test_every_extension_op_has_a_meta_kernel():
    """Read from csrc/bindings.cpp, on any machine: every op the extension defines is `OPS` (all opchecked above) and
    has a Meta kernel, the fake that torch.compile traces it with."""
    source = (Path(__file__).resolve().parents[1] / "csrc" / "bindings.cpp").read_text()
    defined = set(re.findall(r'm\.def\("(\w+)\(', source))
    meta = source.split("TORCH_LIBRARY_IMPL(grpo_kernels, Meta, m)")[1].split("}")[0]
    assert defined == set(OPS)
    assert set(re.findall(r'm\.impl\("(\w+)"', meta)) == defined

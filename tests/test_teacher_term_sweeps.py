"""The GRPO loss sharing the two-head divergence's vocabulary sweeps (`kernels/divergence.py`'s `ChunkTerm`): one
student vocabulary pass per chunk where the loss's transform is the divergence's student's (torch and Triton
divergence backends), its own pass where it is not (both against the float64 oracles), and each backend's chunk
pass's summed gradient against autograd."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpo_kernels import reference_divergence as ref_div
from grpo_kernels.distillation import divergence_options
from grpo_kernels.kernels import divergence
from grpo_kernels.kernels.divergence import DivergenceOptions, chunk_pass, shared_sweeps_refusal
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.torch import token_logprobs
from grpo_kernels.kernels.torch.divergence import ChunkSpec, Head, TokenGradient
from tests.conftest import assert_close
from tests.test_teacher_term import COEF, check, make


@pytest.fixture
def passes(monkeypatch) -> dict:
    """Counts of the student's vocabulary passes: the divergence's chunk passes (and those given a token loss) and
    the torch backend's own token log-prob passes."""
    counts = {"divergence": 0, "with_token_loss": 0, "token_logprobs_fwd": 0, "token_logprobs_bwd": 0}
    chunk_pass = divergence.chunk_pass

    def counted(backend):
        run = chunk_pass(backend)

        def spy(*args, **kwargs):
            counts["divergence"] += 1
            counts["with_token_loss"] += kwargs.get("token_loss") is not None
            return run(*args, **kwargs)

        return spy

    monkeypatch.setattr(divergence, "chunk_pass", counted)
    for name in ("token_logprobs_fwd", "token_logprobs_bwd"):
        original = getattr(token_logprobs, name)

        def spy(*args, name=name, original=original, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(token_logprobs, name, spy)
    return counts


def chunks_of(t: dict) -> int:
    """The one-pass route's chunks: the kept rows, 4 a chunk (`check`'s chunk_size)."""
    return -(-int(t["mask"].sum()) // 4)


def needs(backend: str) -> None:
    """Skip where the backend's kernels cannot run here."""
    if backend == "triton":
        pytest.importorskip("triton")


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo"),  # reverse KL, the default
        dict(loss_type="grpo", entropy_coef=0.01, teacher_divergence={"beta": 0.0}),  # forward KL, dL/dentropy
    ],
    ids=("reverse_kl", "forward_kl_entropy"),
)
def test_one_student_vocabulary_pass_per_chunk_where_the_transforms_agree(options, backend, passes):
    needs(backend)
    t = make(torch.float32, seed=4)
    options = dict(options)  # (shared by the backends' cases)
    teacher = divergence_options(**options.pop("teacher_divergence", {}))
    options |= dict(teacher_kl_coef=COEF, teacher_divergence=dataclasses.replace(teacher, backend=backend))
    check(t, options, torch.float32)
    chunks = chunks_of(t)
    assert passes == {"divergence": chunks, "with_token_loss": chunks, "token_logprobs_fwd": 0, "token_logprobs_bwd": 0}


def test_a_grpo_temperature_other_than_the_divergences_runs_its_own_pass(passes):
    options = dict(loss_type="dapo", temperature=0.7, teacher_kl_coef=COEF, teacher_divergence={"temperature": 1.0})
    t = make(torch.float32, seed=5)
    check(t, options, torch.float32)
    own = chunks_of(t)
    assert passes == {"divergence": own, "with_token_loss": 0, "token_logprobs_fwd": own, "token_logprobs_bwd": own}


def test_both_backends_share_the_sweeps_and_the_own_pass_says_why():
    grpo = PassOptions("torch")
    for backend in ("torch", "triton"):
        assert shared_sweeps_refusal(grpo, DivergenceOptions(beta=1.0, backend=backend)) == ""
        assert "takes no token loss" in shared_sweeps_refusal(grpo, DivergenceOptions(1.0, top_k=4, backend=backend))
        refusal = shared_sweeps_refusal(grpo, DivergenceOptions(1.0, temperature=0.5, backend=backend))
        assert "not the divergence's student's" in refusal


# (beta, with dL/dentropy, case): "softcap" a scaled, soft-capped student head with row weights; "neg_inf" a plain
# head, a -inf logit in both heads' rows and no row weights (1).
TOKEN_POINTS = [(0.0, True, "softcap"), (0.0, False, "neg_inf"), (1.0, True, "neg_inf"), (1.0, False, "softcap"),
                (0.5, True, "softcap"), (0.5, False, "neg_inf")]  # fmt: skip
CHUNK_POINTS = (
    [("torch", beta, with_entropy, "softcap") for beta in (0.0, 1.0, 0.5) for with_entropy in (True, False)]
    + [("torch", *point) for point in TOKEN_POINTS if point[2] == "neg_inf"]
    + [("triton", *point) for point in TOKEN_POINTS]
)


@pytest.mark.parametrize(("backend", "beta", "with_entropy", "case"), CHUNK_POINTS, ids=str)
def test_the_chunk_pass_adds_the_token_loss_gradient(backend, beta, with_entropy, case):
    """dL/dx of L = Σ w·D + g·logp (+ g_H·H) through the student head, against float64 autograd (torch's pass in
    float64, Triton's in float32)."""
    needs(backend)
    dtype = torch.float32 if backend == "triton" else torch.float64
    g = torch.Generator().manual_seed(6)
    c, V, temperature = 5, 37, 0.9
    head = Head(1.3, 4.0) if case == "softcap" else Head()
    x = torch.randn(c, V, generator=g, dtype=torch.float64) * 3
    zt = torch.randn(c, V, generator=g, dtype=torch.float64)
    targets = torch.randint(1, V, (c,), generator=g)
    weight, grad_logp, grad_entropy = (torch.randn(c, generator=g, dtype=torch.float64) for _ in range(3))
    weight = weight if case == "softcap" else None
    grad_entropy = grad_entropy if with_entropy else torch.zeros_like(grad_entropy)
    if case == "neg_inf":
        x[:, 0] = zt[:, 0] = -math.inf  # column 0: no target's
    x = x.to(dtype).double().requires_grad_()
    zs = x * head.logit_scale
    if head.final_logit_softcapping is not None:
        zs = head.final_logit_softcapping * torch.tanh(zs / head.final_logit_softcapping)
    log_ps = torch.log_softmax(zs / temperature, -1)
    entropy = -(log_ps.exp() * log_ps.masked_fill(log_ps.isneginf(), 0.0)).sum(-1)
    per_row, _, _ = ref_div.token_divergence(zs / temperature, zt / temperature, beta)
    rows = per_row if weight is None else weight * per_row
    loss = (rows + grad_logp * log_ps.gather(1, targets[:, None])[:, 0] + grad_entropy * entropy).sum()
    loss.backward()
    got = x.detach().to(dtype)
    seen = {}

    def token_loss(logp, entropy):
        seen.update(logp=logp.clone(), entropy=entropy.clone())
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return TokenGradient(targets, cast(grad_logp), cast(grad_entropy) if with_entropy else None, cast(weight))

    spec = ChunkSpec(beta=beta, temperature=temperature, student=head, teacher=Head(), with_grad=True, block=16)
    values = chunk_pass(backend)(got, zt.to(dtype), targets, spec, token_loss=token_loss)
    assert_close(values[0], per_row.detach(), dtype, "divergence")
    assert_close(seen["entropy"], entropy.detach(), dtype, "entropy")
    assert_close(seen["logp"], log_ps.detach().gather(1, targets[:, None])[:, 0], dtype, "logp")
    assert_close(got, x.grad, dtype, "dL/dx")

"""The GRPO loss sharing the two-head divergence's vocabulary sweeps (`kernels/divergence.py`'s `ChunkTerm`): one
student vocabulary pass per chunk where the loss's transform is the divergence's student's, its own pass where it is
not (both against the float64 oracles), and the torch chunk pass's summed gradient against autograd."""

from __future__ import annotations

import pytest
import torch

from grpo_kernels import reference_divergence as ref_div
from grpo_kernels.kernels import divergence
from grpo_kernels.kernels.divergence import DivergenceOptions, shared_sweeps_refusal
from grpo_kernels.kernels.pass_options import PassOptions
from grpo_kernels.kernels.torch import divergence as torch_divergence
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


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo"),  # reverse KL, the default
        dict(loss_type="grpo", entropy_coef=0.01, teacher_divergence={"beta": 0.0}),  # forward KL, dL/dentropy
    ],
    ids=("reverse_kl", "forward_kl_entropy"),
)
def test_one_student_vocabulary_pass_per_chunk_where_the_transforms_agree(options, passes):
    t = make(torch.float32, seed=4)
    check(t, options | dict(teacher_kl_coef=COEF), torch.float32)
    chunks = chunks_of(t)
    assert passes == {"divergence": chunks, "with_token_loss": chunks, "token_logprobs_fwd": 0, "token_logprobs_bwd": 0}


def test_a_grpo_temperature_other_than_the_divergences_runs_its_own_pass(passes):
    options = dict(loss_type="dapo", temperature=0.7, teacher_kl_coef=COEF, teacher_divergence={"temperature": 1.0})
    t = make(torch.float32, seed=5)
    check(t, options, torch.float32)
    own = chunks_of(t)
    assert passes == {"divergence": own, "with_token_loss": 0, "token_logprobs_fwd": own, "token_logprobs_bwd": own}


def test_the_triton_divergence_keeps_the_own_pass_and_says_why():
    grpo = PassOptions("torch")
    assert shared_sweeps_refusal(grpo, DivergenceOptions(beta=1.0)) == ""
    assert "takes no token loss" in shared_sweeps_refusal(grpo, DivergenceOptions(beta=1.0, backend="triton"))
    assert "not the divergence's student's" in shared_sweeps_refusal(grpo, DivergenceOptions(1.0, temperature=0.5))


@pytest.mark.parametrize("with_entropy", (True, False), ids=("entropy", "no_entropy"))
@pytest.mark.parametrize("beta", (0.0, 1.0, 0.5))
def test_the_chunk_pass_adds_the_token_loss_gradient(beta, with_entropy):
    """dL/dx of L = Σ w·D + g·logp (+ g_H·H) through a soft-capped, scaled student head, against float64 autograd."""
    g = torch.Generator().manual_seed(6)
    c, V, head, temperature = 5, 37, Head(1.3, 4.0), 0.9
    x = (torch.randn(c, V, generator=g, dtype=torch.float64) * 3).requires_grad_()
    zt = torch.randn(c, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (c,), generator=g)
    weight, grad_logp, grad_entropy = (torch.randn(c, generator=g, dtype=torch.float64) for _ in range(3))
    grad_entropy = grad_entropy if with_entropy else torch.zeros_like(grad_entropy)
    zs = head.final_logit_softcapping * torch.tanh(head.logit_scale * x / head.final_logit_softcapping) / temperature
    log_ps = torch.log_softmax(zs, -1)
    entropy = -(log_ps.exp() * log_ps).sum(-1)
    per_row, _, _ = ref_div.token_divergence(zs, zt / temperature, beta)
    loss = (weight * per_row + grad_logp * log_ps.gather(1, targets[:, None])[:, 0] + grad_entropy * entropy).sum()
    loss.backward()
    got = x.detach().clone()
    seen = {}

    def token_loss(logp, entropy):
        seen.update(logp=logp.clone(), entropy=entropy.clone())
        return TokenGradient(targets, grad_logp, grad_entropy if with_entropy else None, weight)

    spec = ChunkSpec(beta=beta, temperature=temperature, student=head, teacher=Head(), with_grad=True, block=16)
    values = torch_divergence.divergence_chunk(got, zt.clone(), targets, spec, token_loss=token_loss)
    assert_close(values[0], per_row.detach(), torch.float64, "divergence")
    assert_close(seen["entropy"], entropy.detach(), torch.float64, "entropy")
    assert_close(got, x.grad, torch.float64, "dL/dx")

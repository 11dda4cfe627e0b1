"""`fused_linear_divergence` against the peers' own code on the same inputs: TRL 1.16's `_chunked_divergence_loss`
(`DistillationTrainer`'s loss, on `ChunkedDivergenceFunction`'s torch tiles on CPU) and Liger's `LigerFusedLinearJSD`
(its Triton kernel under the interpreter on CPU): loss, entropy and every student gradient."""

from __future__ import annotations

import pytest
import torch

from grpo_kernels import fused_linear_divergence
from tests.conftest import assert_close

B, T, HS, HT, V = 2, 6, 16, 24, 257
TRANSFORMS = dict(temperature=0.8, student_logit_scale=1.25, teacher_logit_scale=0.9,
                  student_final_logit_softcapping=5.0, teacher_final_logit_softcapping=7.0)  # fmt: skip


def _inputs(dtype: torch.dtype, with_bias: bool = True):
    g = torch.Generator().manual_seed(1)
    t = {
        "student_hidden": torch.randn(B, T, HS, generator=g).to(dtype),
        "student_weight": (torch.randn(V, HS, generator=g) / 3).to(dtype),
        "teacher_hidden": torch.randn(B, T, HT, generator=g).to(dtype),
        "teacher_weight": (torch.randn(V, HT, generator=g) / 3).to(dtype),
    }
    if with_bias:
        t["student_bias"] = (torch.randn(V, generator=g) / 2).to(dtype)
        t["teacher_bias"] = (torch.randn(V, generator=g) / 2).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    return t, mask


def _student(t: dict) -> dict:
    return {k: v.detach().clone().requires_grad_() for k, v in t.items() if k.startswith("student")}


def _grads(x: dict) -> dict:
    return {k: v.grad for k, v in x.items()}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("num_items", (None, 13.0))
@pytest.mark.parametrize("beta", (0.0, 1.0, 0.3))
def test_equals_trl_chunked_divergence_loss(beta, num_items, dtype):
    distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")
    t, mask = _inputs(dtype)
    theirs = _student(t)
    loss, entropy_sum, n_valid = distillation_trainer._chunked_divergence_loss(
        theirs["student_hidden"], t["teacher_hidden"], theirs["student_weight"], t["teacher_weight"], mask.long(),
        beta, num_items_in_batch=num_items, student_lm_head_bias=theirs["student_bias"],
        teacher_lm_head_bias=t["teacher_bias"], **TRANSFORMS,
    )  # fmt: skip
    loss.backward()
    ours = _student(t)
    rest = {k: v for k, v in t.items() if k not in ours}
    out = fused_linear_divergence(**ours, **rest, mask=mask, beta=beta, num_items_in_batch=num_items, **TRANSFORMS)
    out.loss.backward()
    assert int(out.num_valid) == int(n_valid)
    assert_close(out.loss, loss, torch.float32, "loss")
    assert_close(out.entropy.sum(), entropy_sum, torch.float32, "entropy sum")
    for name, grad in _grads(ours).items():
        assert grad.dtype == theirs[name].grad.dtype
        assert_close(grad, theirs[name].grad, torch.float32 if dtype == torch.float32 else dtype, f"d{name}")


@pytest.mark.parametrize("beta", (0.0, 1.0, 0.5))
def test_equals_trl_chunked_divergence_function_per_token(beta):
    """The per-token divergence and entropy of TRL's Function itself, every token kept."""
    chunked_divergence = pytest.importorskip("trl.kernels.chunked_divergence")
    t, _ = _inputs(torch.float32)
    flat = {k: v.reshape(-1, v.shape[-1]) if v.dim() == 3 else v for k, v in t.items()}
    divergence, entropy = chunked_divergence.ChunkedDivergenceFunction.apply(
        flat["student_hidden"], flat["student_weight"], flat["student_bias"], flat["teacher_hidden"],
        flat["teacher_weight"], flat["teacher_bias"], beta, TRANSFORMS["temperature"],
        TRANSFORMS["student_logit_scale"], TRANSFORMS["student_final_logit_softcapping"],
        TRANSFORMS["teacher_logit_scale"], TRANSFORMS["teacher_final_logit_softcapping"],
    )  # fmt: skip
    out = fused_linear_divergence(**flat, beta=beta, **TRANSFORMS)
    assert_close(out.divergence, divergence, torch.float32, "divergence")
    assert_close(out.entropy, entropy, torch.float32, "entropy")


@pytest.mark.parametrize("beta", (0.0, 1.0, 0.5))
def test_equals_liger_fused_linear_jsd(beta):
    liger = pytest.importorskip("liger_kernel.transformers.fused_linear_jsd")
    t, mask = _inputs(torch.float32, with_bias=False)
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in t.items()}
    labels = torch.where(mask, 0, -100).reshape(-1)  # Liger drops the tokens whose label is ignore_index
    theirs = _student(flat)
    loss = liger.LigerFusedLinearJSD(jsd_beta=beta, ignore_index=-100, temperature=0.8)(
        theirs["student_hidden"], theirs["student_weight"], flat["teacher_hidden"], flat["teacher_weight"], labels
    )
    loss.backward()
    ours = _student(flat)
    out = fused_linear_divergence(**ours, teacher_hidden=flat["teacher_hidden"],
                                  teacher_weight=flat["teacher_weight"], mask=mask.reshape(-1), beta=beta,
                                  temperature=0.8)  # fmt: skip
    out.loss.backward()
    assert_close(out.loss, loss, torch.float32, "loss")
    for name, grad in _grads(ours).items():
        assert_close(grad, theirs[name].grad, torch.float32, f"d{name}")

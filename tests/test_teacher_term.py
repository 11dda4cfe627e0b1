"""The GRPO loss with a teacher term (`teacher_kl_coef`, `teacher_term.py`) against the float64 oracles: the GRPO
reference plus teacher_kl_coef · the divergence reference weighted as the loss type weighs each token (loss and
the student's gradients), on the one-pass route and the two-pass ones, fp32 and bf16, masked and packed; refusals."""

from __future__ import annotations

import pytest
import torch

from grpo_kernels import GRPOLoss, LossOptions, fused_linear_grpo_loss, grpo_loss, reference, teacher_term
from grpo_kernels import reference_divergence as ref_div
from grpo_kernels.distillation import teacher_divergence_fields
from grpo_kernels.kernels.divergence import DivergenceOptions
from tests.conftest import assert_close

B, T, H, HT, V = 3, 5, 16, 24, 37
COEF = 0.7
DIVERGENCES = {  # name -> teacher_divergence
    "reverse": None,
    "jsd_transforms": {
        "beta": 0.5,
        "temperature": 0.8,
        "teacher_logit_scale": 1.3,
        "teacher_final_logit_softcapping": 5.0,
    },  # fmt: skip
    "forward_topk": {"beta": 0.0, "top_k": 4},
}


def make(dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[-1, :2] = False
    t = {
        "hidden": torch.randn(B, T, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / 2,
        "bias": torch.randn(V, generator=g) / 2,
        "teacher_hidden": torch.randn(B, T, HT, generator=g),
        "teacher_weight": torch.randn(V, HT, generator=g) / 2,
        "teacher_bias": torch.randn(V, generator=g) / 2,
    }
    t = {k: v.to(dtype) for k, v in t.items()}
    with torch.no_grad():
        logp, _ = reference.token_logprobs(t["hidden"].double() @ t["weight"].double().T + t["bias"].double(),
                                           targets := torch.randint(0, V, (B, T), generator=g))  # fmt: skip
    t |= {
        "targets": targets,
        "mask": mask,
        "advantages": torch.randn(B, generator=g),
        "old_logp": (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float(),
        "ref_logp": (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float(),
    }
    return t


def omega(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """Each token's weight in the loss type's reduction, float64 [B, T]: dapo Σ / kept count, grpo the mean over
    sequences of each one's token mean."""
    m = mask.double()
    if loss_type == "dapo":
        return m / m.sum()
    return m / (m.shape[0] * m.sum(1, keepdim=True).clamp(min=1))


def oracle(t: dict, options: dict, divergence: dict | DivergenceOptions | None) -> tuple[torch.Tensor, dict]:
    if isinstance(divergence, DivergenceOptions):
        divergence = teacher_divergence_fields(divergence)
    p = {k: t[k].detach().double().requires_grad_() for k in ("hidden", "weight", "bias")}
    logits = p["hidden"] @ p["weight"].T + p["bias"]
    args = {k: t[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")}
    grpo = {k: v for k, v in options.items() if k not in ("teacher_kl_coef", "teacher_divergence")}
    loss, _ = reference.grpo_loss(logits, **args, **grpo)
    div = {"beta": 1.0, "temperature": 1.0} | (divergence or {})
    zs = ref_div.head_logits(p["hidden"], p["weight"], p["bias"], temperature=div["temperature"])
    zt = ref_div.head_logits(t["teacher_hidden"], t["teacher_weight"], t["teacher_bias"],
                             logit_scale=div.get("teacher_logit_scale", 1.0), temperature=div["temperature"],
                             final_logit_softcapping=div.get("teacher_final_logit_softcapping"))  # fmt: skip
    if div.get("top_k"):
        per_token, _ = ref_div.topk_divergence(zs, zt, div["beta"], div["top_k"])
    else:
        per_token, _, _ = ref_div.token_divergence(zs, zt, div["beta"])
    loss = loss + COEF * (omega(t["mask"], grpo.get("loss_type", "dapo")) * per_token).sum()
    loss.backward()
    return loss, {k: v.grad for k, v in p.items()}


def ours(t: dict, options: dict, *, packed: bool = False, **call) -> tuple[torch.Tensor, dict, dict]:
    p = {k: t[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    args = {k: t[k] for k in ("targets", "old_logp", "ref_logp", "mask", "teacher_hidden")}
    hidden, advantages = p["hidden"], t["advantages"]
    if packed:  # the kept tokens only, one sequence per row
        mask = t["mask"]
        hidden = hidden[mask]
        args = {k: v[mask] for k, v in args.items()} | {"mask": None}
        call["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
    out = fused_linear_grpo_loss(hidden, p["weight"], args.pop("targets"), advantages, **args, bias=p["bias"],
                                 teacher_weight=t["teacher_weight"], teacher_bias=t["teacher_bias"],
                                 **({"chunk_size": 4} if "memory" not in call else {}), **options, **call)  # fmt: skip
    if torch.is_grad_enabled():
        out.loss.backward()
    return out.loss, out.metrics, {k: v.grad for k, v in p.items()}


@pytest.fixture
def one_pass_chunks(monkeypatch) -> list:
    """The chunks the one-pass route's GRPO term ran on."""
    calls, original = [], teacher_term.GRPOChunk.__call__

    def spy(self, rows, logits, grad_out):
        calls.append(rows)
        return original(self, rows, logits, grad_out)

    monkeypatch.setattr(teacher_term.GRPOChunk, "__call__", spy)
    return calls


def check(t: dict, options: dict, dtype: torch.dtype, **call) -> None:
    loss, metrics, grads = ours(t, options, **call)
    ref_loss, ref_grads = oracle(t, options, options.get("teacher_divergence"))
    assert_close(loss, ref_loss, dtype, "loss")
    assert torch.isfinite(metrics["teacher/divergence"])
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        assert_close(grad, ref_grads[name], dtype, f"grad {name}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_one_pass_matches_the_oracles(divergence, dtype, one_pass_chunks):
    options = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, teacher_kl_coef=COEF,
                   teacher_divergence=DIVERGENCES[divergence])  # fmt: skip
    check(make(dtype), options, dtype)
    assert len(one_pass_chunks) == 3  # 12 kept rows, 4 a chunk: the GRPO loss ran inside the two-head pass


@pytest.mark.parametrize(
    "route, options",
    [
        ("grpo_normaliser", dict(loss_type="grpo", entropy_coef=0.01)),  # one pass, each sequence's token mean
        ("sequence_level", dict(loss_type="grpo", importance_sampling_level="sequence")),  # two passes
        ("lean", dict(loss_type="dapo", memory="lean", tile=(4, 16))),  # two passes
    ],
)
def test_other_normalisers_and_the_two_pass_routes(route, options, one_pass_chunks):
    call = {k: options.pop(k) for k in ("memory", "tile") if k in options}
    options |= dict(teacher_kl_coef=COEF, teacher_divergence={"beta": 0.5})
    check(make(torch.float32, seed=1), options, torch.float32, **call)
    assert bool(one_pass_chunks) == (route == "grpo_normaliser")


def test_packed_matches_the_padded_oracle():
    check(make(torch.float32, seed=2), dict(loss_type="dapo", teacher_kl_coef=COEF), torch.float32, packed=True)


def test_without_gradient_the_loss_is_the_same_and_the_module_takes_the_teacher():
    t, options = make(torch.float32, seed=3), dict(loss_type="dapo", teacher_kl_coef=COEF)
    with torch.no_grad():
        loss, _, _ = ours(t, options)
    ref_loss, _ = oracle(t, options, None)
    assert_close(loss, ref_loss, torch.float32, "loss")
    module = GRPOLoss(**options, chunk_size=4)
    args = (t["targets"], t["advantages"], t["old_logp"], t["ref_logp"], t["mask"])
    out = module(t["hidden"], t["weight"], *args, bias=t["bias"], teacher_hidden=t["teacher_hidden"],
                 teacher_weight=t["teacher_weight"], teacher_bias=t["teacher_bias"])  # fmt: skip
    assert_close(out.loss, ref_loss, torch.float32, "module loss")


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(teacher_hidden=None), ValueError, "needs teacher_hidden and teacher_weight"),
        (dict(teacher_weight="wide"), ValueError, "teacher_weight must be [V, H_t] with the student's V = 37"),
        (dict(teacher_hidden="short"), ValueError, "teacher_hidden must be [3, 5, 'H_t'] like hidden"),
        (dict(teacher_divergence={"beta": 2.0}), ValueError, "teacher_divergence: beta must be in [0, 1]"),
        (dict(teacher_divergence={"student_logit_scale": 2.0}), TypeError, "unknown option 'student_logit_scale'"),
        (dict(teacher_divergence={"top_k": V}), ValueError, "top_k must be < V = 37"),
        (dict(teacher_kl_coef=-1.0), ValueError, "teacher_kl_coef must be >= 0"),
        (dict(return_sequence_losses=True), ValueError, "does not run with return_sequence_losses"),
    ],
)
def test_refusals_name_the_argument(change, error, message):
    t = make(torch.float32)
    swaps = {"wide": t["teacher_weight"][:-1], "short": t["teacher_hidden"][:, :-1]}
    kwargs = dict(teacher_kl_coef=COEF, teacher_hidden=t["teacher_hidden"], teacher_weight=t["teacher_weight"])
    kwargs |= {k: swaps.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        fused_linear_grpo_loss(t["hidden"], t["weight"], t["targets"], t["advantages"], mask=t["mask"], **kwargs)


def test_the_logits_form_refuses_the_term_and_the_term_off_is_the_plain_loss():
    t = make(torch.float32)
    with pytest.raises(ValueError, match="needs the teacher's hidden states and lm_head"):
        grpo_loss(torch.randn(B, T, V), t["targets"], t["advantages"], teacher_kl_coef=COEF)
    plain, _, _ = ours(t, dict(loss_type="dapo"))
    off, _, _ = ours(t, dict(loss_type="dapo", teacher_kl_coef=0.0))
    assert torch.equal(plain, off)
    assert LossOptions(teacher_divergence={"beta": 0.5}).teacher_divergence.beta == 0.5


def test_a_non_finite_teacher_row_is_named():
    t = make(torch.float32)
    t["mask"][0, 1] = True
    t["teacher_hidden"][0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"teacher_hidden: the teacher head's logits at token \(0, 1\)"):
        ours(t, dict(loss_type="dapo", teacher_kl_coef=COEF))

"""The two-head divergence (`fused_linear_divergence`) against the float64 oracle (`reference_divergence`): loss,
per-token divergence, entropy, log-prob and every student gradient, for each divergence and dtype on the hard cases;
the teacher gets no gradient; the top-k-plus-tail variant; the refusals and argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_kernels import FusedLinearDivergence, fused_linear_divergence
from grpo_kernels import reference_divergence as ref
from grpo_kernels.kernels import divergence_lean
from grpo_kernels.kernels.divergence import DivergenceOptions, fused_linear_divergence_rows
from grpo_kernels.kernels.torch.divergence import ChunkSpec, Head
from tests.conftest import DTYPES, assert_close

B, T, HS, HT, V = 2, 5, 16, 24, 301  # V prime: no chunk or block divides it
BETAS = (0.0, 1.0, 0.5)
CASES = ("plain", "transforms", "neg_inf_both", "one_hot_teacher", "masked", "packed", "non_contiguous")


def _inputs(case: str, dtype: torch.dtype, seed: int = 0) -> tuple[dict, dict]:
    """(student/teacher tensors, options) for a named hard case."""
    g = torch.Generator().manual_seed(seed)
    lead = (B * T,) if case == "packed" else (B, T)
    t = {
        "student_hidden": torch.randn(*lead, HS, generator=g),
        "student_weight": torch.randn(V, HS, generator=g) / 3,
        "teacher_hidden": torch.randn(*lead, HT, generator=g),
        "teacher_weight": torch.randn(V, HT, generator=g) / 3,
        "student_bias": torch.randn(V, generator=g) / 2,
        "teacher_bias": torch.randn(V, generator=g) / 2,
        "targets": torch.randint(0, V, lead, generator=g),
    }
    opts = {}
    if case == "transforms":
        opts = dict(temperature=0.7, student_logit_scale=1.5, teacher_logit_scale=0.8,
                    student_final_logit_softcapping=4.0, teacher_final_logit_softcapping=6.0)  # fmt: skip
    if case == "neg_inf_both":  # vocabulary ids no head can emit: 0·log 0 terms everywhere
        for name in ("student_bias", "teacher_bias"):
            t[name][[0, 7, V - 1]] = -math.inf
    if case == "one_hot_teacher":  # the teacher puts all its mass on one id
        t["teacher_bias"].fill_(-math.inf)[11] = 0.0
    if case in ("masked", "packed"):
        t["mask"] = torch.rand(lead, generator=g) > 0.4
        t["mask"].view(-1)[0] = False
        t["student_hidden"][~t["mask"]] = math.nan  # dropped tokens are never read
        t["teacher_hidden"][~t["mask"]] = math.nan
    t = {k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()}
    if case == "non_contiguous":  # strided views of larger tensors
        t["student_hidden"] = torch.cat([t["student_hidden"]] * 2, -1)[..., ::2]
        t["student_weight"] = t["student_weight"].T.contiguous().T
        t["teacher_hidden"] = t["teacher_hidden"].transpose(0, 1).contiguous().transpose(0, 1)
    return t, opts


def _run(t: dict, opts: dict, beta: float, **extra):
    student = {k: t[k].detach().clone().requires_grad_() for k in ("student_hidden", "student_weight", "student_bias")}
    rest = {k: v for k, v in t.items() if k not in student}
    out = fused_linear_divergence(**student, **rest, beta=beta, **{"chunk_size": 3, **opts, **extra})
    out.loss.backward()
    return out, {k: v.grad for k, v in student.items()}


def _oracle(t: dict, opts: dict, beta: float, **extra):
    student = {k: t[k].detach().double().requires_grad_() for k in ("student_hidden", "student_weight", "student_bias")}
    rest = {k: v for k, v in t.items() if k not in student}
    out = ref.fused_linear_divergence(**student, **rest, beta=beta, **opts, **extra)
    out["loss"].backward()
    kept = t.get("mask", torch.ones(t["targets"].shape, dtype=torch.bool))
    student["student_hidden"].grad[~kept] = 0  # NaN rows the oracle sent through where()
    return out, {k: v.grad for k, v in student.items()}


# A few points for the Triton pass (its interpreter takes seconds a point) and for memory="lean" (torch, in tiles of 3
# rows × 128 columns): every divergence on the transforms, each hard case once, each half dtype once.
FEW_POINTS = [(beta, torch.float32, "transforms") for beta in BETAS] + [
    (0.5, torch.float32, "neg_inf_both"),
    (0.0, torch.float32, "one_hot_teacher"),
    (1.0, torch.float32, "masked"),
    (0.5, torch.bfloat16, "non_contiguous"),
    (0.0, torch.float16, "packed"),
]
ORACLE_POINTS = (
    [("torch", "fast", beta, dtype, case) for beta in BETAS for dtype in DTYPES for case in CASES]
    + [("triton", "fast", *point) for point in FEW_POINTS]
    + [("torch", "lean", *point) for point in FEW_POINTS]
)


@pytest.fixture
def small_lean_tiles(monkeypatch):
    """Lean tiles of 128 columns for 3 rows (V = 301: two whole tiles and a tail)."""
    monkeypatch.setitem(divergence_lean.TILE_BYTES, "cpu", 2 * 4 * 3 * 128)


@pytest.mark.parametrize(("backend", "memory", "beta", "dtype", "case"), ORACLE_POINTS, ids=str)
def test_matches_the_float64_oracle(backend, memory, beta, dtype, case, launches, small_lean_tiles):
    t, opts = _inputs(case, dtype)
    out, grads = _run(t, opts, beta, backend=backend, memory=memory)
    want, want_grads = _oracle(t, opts, beta)
    if case == "one_hot_teacher" and beta == 1.0:  # KL(p_s || one-hot) is infinite
        assert torch.isposinf(out.loss) and torch.isposinf(want["loss"])
        return
    kept = int(t["mask"].sum()) if "mask" in t else B * T
    assert launches == {backend: math.ceil(kept / 3)}  # one per chunk of 3 kept rows, on the backend asked for
    assert_close(out.loss, want["loss"], dtype, "loss")
    for name in ("divergence", "entropy", "logp"):
        assert_close(getattr(out, name), want[name], dtype, name)
    for name, grad in grads.items():
        assert grad.dtype == t[name].dtype and torch.isfinite(grad).all(), name
        assert_close(grad, want_grads[name], dtype, f"d{name}")


@pytest.mark.parametrize(("backend", "beta"), [("torch", beta) for beta in BETAS] + [("triton", 1.0)])
def test_teacher_excluding_a_token_the_student_reaches(backend, beta):
    """-inf in the teacher only: forward KL and the JSD stay finite; the reverse KL is +inf, as the oracle says."""
    t, _ = _inputs("plain", torch.float32)
    t["teacher_bias"][[2, 9]] = -math.inf
    out = fused_linear_divergence(**t, beta=beta, backend=backend)
    want = ref.fused_linear_divergence(**t, beta=beta)
    if beta == 1.0:
        assert torch.isposinf(out.loss) and torch.isposinf(want["loss"])
    else:
        assert_close(out.loss, want["loss"], torch.float32, "loss")


# The top-k-plus-tail variant: every divergence, ids given or the teacher's, on torch; on Triton the JSD on the
# transforms and the hard cases and half dtypes of FEW_POINTS (each divergence among them), ids given at every other.
TOPK_TRITON = [point for point in FEW_POINTS if point[2] != "transforms" or point[0] == 0.5]
TOPK_POINTS = [("torch", beta, torch.float32, "transforms", given) for beta in BETAS for given in (False, True)] + [
    ("triton", *point, bool(i % 2)) for i, point in enumerate(TOPK_TRITON)
]


@pytest.mark.parametrize(("backend", "beta", "dtype", "case", "given"), TOPK_POINTS, ids=str)
def test_topk_plus_tail_matches_the_oracle(backend, beta, dtype, case, given, launches):
    t, opts = _inputs(case, dtype)
    lead = t["targets"].shape
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:6].expand(*lead, 6) if given else None
    out, grads = _run(t, opts, beta, top_k=6, topk_ids=ids, backend=backend)
    want, want_grads = _oracle(t, opts, beta, top_k=6, topk_ids=ids)
    kept = int(t["mask"].sum()) if "mask" in t else B * T
    assert launches == {backend: math.ceil(kept / 3)}
    assert torch.equal(out.topk_ids, want["topk_ids"])
    for name in ("loss", "divergence", "entropy", "logp"):
        assert_close(getattr(out, name), want[name], dtype, name)
    for name, grad in grads.items():
        assert grad.dtype == t[name].dtype and torch.isfinite(grad).all(), name
        assert_close(grad, want_grads[name], dtype, f"d{name}")


def test_triton_topk_ids_follow_a_negative_teacher_scale():
    """The Triton pass takes the raw logits' top k, or bottom k where the teacher's scale flips their order: the
    same ids and numbers as the torch pass, which ranks the transformed logits."""
    from grpo_kernels.kernels.divergence import chunk_pass

    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(4, V, generator=g), torch.randn(4, V, generator=g)
    spec = ChunkSpec(beta=0.5, temperature=0.7, student=Head(), teacher=Head(-1.5, 3.0), with_grad=True)
    grad_torch, grad_triton = zs.clone(), zs.clone()  # each pass writes dD/dx over its student logits
    want = chunk_pass("torch", True)(grad_torch, zt.clone(), None, spec, k=5, ids=None)
    got = chunk_pass("triton", True)(grad_triton, zt.clone(), None, spec, k=5, ids=None)
    assert torch.equal(got[-1], want[-1])
    for name, a, b in zip(("divergence", "entropy", "lse_s", "lse_t"), (*got[:2], *got[3:5]), (*want[:2], *want[3:5]),
                          strict=True):  # fmt: skip
        assert_close(a, b, torch.float32, name)
    assert_close(grad_triton, grad_torch, torch.float32, "dD/dx")


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_topk_nan_teacher_logit_outside_the_ids_is_not_hidden(backend):
    """A NaN teacher logit outside the given ids (the Triton pass marks the ids NaN) makes that row's divergence NaN."""
    from grpo_kernels.kernels.divergence import chunk_pass

    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(3, V, generator=g), torch.randn(3, V, generator=g)
    zt[1, 40] = math.nan
    ids = torch.tensor([[3, 7], [3, 7], [3, 7]])
    spec = ChunkSpec(beta=0.5, temperature=1.0, student=Head(), teacher=Head(), with_grad=True)
    divergence, *_ = chunk_pass(backend, True)(zs, zt, None, spec, k=2, ids=ids)
    assert torch.isnan(divergence[1]) and torch.isfinite(divergence[[0, 2]]).all()


@pytest.mark.parametrize("memory", ("fast", "lean"))
@pytest.mark.parametrize("beta", BETAS)
def test_vocabulary_blocks_and_row_chunks_that_do_not_divide(beta, memory):
    """The chunk pass itself, with blocks (lean: tiles) of 64 columns (V = 301) and 4-row chunks, against the
    oracle."""
    t, opts = _inputs("transforms", torch.float32)
    flat = {k: v.reshape(-1, v.shape[-1]) if v.dim() == 3 else v for k, v in t.items()}
    student = [flat[k].clone().requires_grad_() for k in ("student_hidden", "student_weight", "student_bias")]
    options = DivergenceOptions(beta=beta, temperature=0.7, student=Head(1.5, 4.0), teacher=Head(0.8, 6.0),
                                chunk_size=4, block=64, memory=memory, tile=(4, 64))  # fmt: skip
    teacher = (flat["teacher_hidden"], flat["teacher_weight"], flat["teacher_bias"])
    total, _ = fused_linear_divergence_rows(tuple(student), teacher, None, None, options)
    loss = total / (B * T)
    loss.backward()
    want, want_grads = _oracle(t, opts, beta)
    assert_close(loss, want["loss"], torch.float32, "loss")
    for x, name in zip(student, ("student_hidden", "student_weight", "student_bias"), strict=True):
        assert_close(x.grad.reshape(want_grads[name].shape), want_grads[name], torch.float32, name)


def test_teacher_gets_no_gradient_and_reduction_follows_num_items():
    t, _ = _inputs("masked", torch.float32)
    t["teacher_weight"].requires_grad_()
    t["student_hidden"] = t["student_hidden"].requires_grad_()
    out = fused_linear_divergence(**t, num_items_in_batch=torch.tensor(40.0))
    out.loss.backward()
    assert t["teacher_weight"].grad is None
    unreduced = out.divergence.sum() / 40
    assert_close(out.loss, unreduced, torch.float32, "loss")
    assert int(out.num_valid) == int(t["mask"].sum())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_lean_with_every_row_in_one_tile(dtype):
    """memory="lean" without chunk_size: one row tile, so each vocabulary tile's dW comes from one GEMM (written in
    place for float32 weights)."""
    t, opts = _inputs("transforms", dtype)
    out, grads = _run(t, opts, 0.5, memory="lean", chunk_size=None)
    want, want_grads = _oracle(t, opts, 0.5)
    assert_close(out.loss, want["loss"], dtype, "loss")
    for name, grad in grads.items():
        assert grad.dtype == t[name].dtype
        assert_close(grad, want_grads[name], dtype, f"d{name}")


def test_triton_chunk_pass_on_strided_logits():
    """The Triton chunk pass reads and writes logits through their strides (here column-major views) and agrees with
    the torch pass, gradient included."""
    from grpo_kernels.kernels.torch import divergence as torch_pass
    from grpo_kernels.kernels.triton import divergence as triton_pass

    g = torch.Generator().manual_seed(3)
    zs, zt = (torch.randn(V, 4, generator=g).mul_(3).T for _ in range(2))  # [4, V], strides (1, 4)
    targets = torch.randint(0, V, (4,), generator=g)
    spec = torch_pass.ChunkSpec(0.5, 0.7, student=Head(1.5, 4.0), teacher=Head(0.8, 6.0), with_grad=True)
    want = torch_pass.divergence_chunk(zs.contiguous(), zt.contiguous(), targets, spec)
    grad = zs.contiguous()
    torch_pass.divergence_chunk(grad, zt.contiguous(), targets, spec)
    got = triton_pass.divergence_chunk(zs, zt, targets, spec)
    for name, a, b in zip(triton_pass.OUTPUTS, got, want, strict=True):
        assert_close(a, b, torch.float32, name)
    assert_close(zs, grad, torch.float32, "gradient")


def test_module_holds_the_options():
    t, opts = _inputs("transforms", torch.float32)
    module = FusedLinearDivergence(beta=0.5, **opts)
    direct = fused_linear_divergence(**t, beta=0.5, **opts)
    called = module(t.pop("student_hidden"), t.pop("student_weight"), t.pop("teacher_hidden"), t.pop("teacher_weight"),
                    **t)  # fmt: skip
    assert torch.equal(direct.loss, called.loss)
    with pytest.raises(TypeError, match="mask"):
        FusedLinearDivergence(mask=None)


@pytest.mark.parametrize("memory", ("fast", "lean"))
def test_every_token_dropped_gives_zero_and_zero_gradients(memory):
    t, _ = _inputs("plain", torch.float32)
    t["mask"] = torch.zeros(B, T, dtype=torch.bool)
    out, grads = _run(t, {}, 1.0, memory=memory)
    assert out.loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads.values())


REFUSALS = [
    (dict(backend="cuda"), "backend='cuda': the two-head divergence has no CUDA"),
    (dict(memory="lean", top_k=3), "top_k > 0 with memory='lean'"),
    (dict(memory="lean", backend="triton"), "backend='triton': memory='lean' .* runs on backend='torch' only"),
    (dict(process_group=object()), "vocabulary-parallel"),
    (dict(backend="jax"), "backend must be one of"),
]
BAD = [
    (dict(beta=1.5), "beta must be in"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(top_k=V), "top_k must be"),
    (dict(chunk_size=0), "chunk_size must be"),
    (dict(mask=torch.ones(B, T + 1)), r"mask must be \[2, 5\]"),
    (dict(mask=torch.full((B, T), 2)), "mask must hold only 0 and 1"),
    (dict(targets=torch.full((B, T), V)), "targets must be in"),
    (dict(student_bias=torch.zeros(V + 1)), "student_bias must be"),
    (dict(teacher_weight=torch.zeros(V + 1, HT)), "teacher_weight must be"),
    (dict(teacher_hidden=torch.zeros(B, T + 1, HT)), "teacher_hidden must be"),
    (dict(student_weight=torch.zeros(V, HS + 1)), "student_weight must be"),
    (dict(top_k=3, topk_ids=torch.zeros(B, T, 3, dtype=torch.long)), "topk_ids must hold distinct ids"),
    (dict(student_final_logit_softcapping=-1.0), "student_final_logit_softcapping must be"),
]


def _named(x) -> str:
    """A point's id: the changed arguments' names (an object's address differs between xdist workers)."""
    return ",".join(x) if isinstance(x, dict) else x[:30]


@pytest.mark.parametrize(("change", "message"), REFUSALS + BAD, ids=_named)
def test_refusals_and_bad_arguments_name_the_argument(change, message, launches):
    t, _ = _inputs("plain", torch.float32)
    with pytest.raises((ValueError, TypeError), match=message):
        fused_linear_divergence(**(t | change))
    assert not launches


def test_triton_refuses_float64_heads_saying_why(launches):
    t, _ = _inputs("plain", torch.float64)
    with pytest.raises(ValueError, match="backend='triton': float64 heads: the Triton divergence computes in float32"):
        fused_linear_divergence(**t, backend="triton")
    assert not launches


def test_non_finite_logits_are_named():
    t, _ = _inputs("plain", torch.float32)
    t["teacher_hidden"][1, 2, 0] = math.nan
    with pytest.raises(ValueError, match=r"teacher_hidden: .* token \(1, 2\)"):
        fused_linear_divergence(**t)

"""The optional statistics of the vocabulary pass (`stats=`), as TRL's ChunkedLogProbFunction defines them, against
float64 formulas on the transformed logits z (scale, soft-cap, then / temperature):
log_sum_sq_probs = log Σ_v softmax(z)_v², mean_logits = Σ_v z_v / V, is_top1 = target is the first argmax of z.
Every backend that computes them x dtype x hard case, logits in and the fused lm_head."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.engine import validate
from grpo_kernels.kernels.cuda import launchers as cuda
from grpo_kernels.kernels.protocol import TOKEN_STATS, VocabPassArgs
from tests.cases import CASE_IDS, CASES, Case, make_inputs
from tests.conftest import BACKENDS, DEVICE, DTYPES, assert_close
from tests.helpers import oracle_logits

STATS_BACKENDS = [b for b in BACKENDS if b != "cuda"]
TRANSFORMS = {"plain": {}, "scaled_softcapped": dict(logit_scale=1.7, final_logit_softcapping=2.5)}


def transformed(logits: torch.Tensor, temperature: float, logit_scale=1.0, final_logit_softcapping=None):
    """float64 z the softmax sees, from float64 raw logits."""
    z = logits * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    return z / temperature


def expected_stats(z: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics from their formulas, 0 / False at masked rows."""
    log_q = torch.log_softmax(z, -1)
    out = {
        "log_sum_sq_probs": torch.logsumexp(2 * log_q, -1),
        "mean_logits": z.sum(-1) / z.shape[-1],
        "is_top1": z.argmax(-1) == targets,  # argmax: the first maximum
    }
    return {name: x.masked_fill(~mask, 0) for name, x in out.items()}


def near_miss(z: torch.Tensor) -> torch.Tensor:
    """Rows whose max has a runner-up within float32 rounding but not equal to it: the top-1 there depends on
    rounding the float64 oracle does not do. Exact ties (equal inputs, or tanh saturated in both) stay checked."""
    top = z.max(-1, keepdim=True).values
    gap = top - z
    tol = 1e-5 * z.abs().amax(-1, keepdim=True).nan_to_num(posinf=1.0).clamp(min=1.0)
    return ((gap > 0) & (gap < tol)).any(-1)


def assert_stats(ours: dict, z: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, dtype) -> None:
    targets, mask = targets.cpu(), mask.cpu()
    expected = expected_stats(z, targets, mask)
    for name in ("log_sum_sq_probs", "mean_logits"):
        x, ref = ours[name].detach().double().cpu(), expected[name]
        assert ours[name].dtype == torch.float32 and not ours[name].requires_grad, name
        finite = torch.isfinite(ref)
        assert torch.equal(x[~finite], ref[~finite]), f"{name}: the infinite values (−inf logits' mean) differ"
        assert_close(x.where(finite, 0.0), ref.where(finite, 0.0), dtype, name)
    top1 = ours["is_top1"].cpu()
    assert top1.dtype == torch.bool and not top1[~mask].any()
    checked = ~near_miss(z)
    assert torch.equal(top1[checked], expected["is_top1"][checked]), "is_top1"


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", STATS_BACKENDS)
def test_stats_match_formulas(backend, dtype, case, transform, launches):
    inputs = make_inputs(case, dtype, DEVICE)
    logits, targets, mask = inputs["logits"].requires_grad_(), inputs["targets"], inputs["mask"]
    if case.name != "extreme_logits":  # a few targets at the argmax, so is_top1 is True somewhere
        targets = torch.where(torch.arange(case.T, device=DEVICE) % 2 == 0, logits.nan_to_num(0).argmax(-1), targets)
    z = transformed(oracle_logits(logits).detach(), case.temperature, **TRANSFORMS[transform])
    ours = gk.token_logprobs(
        logits,
        targets,
        temperature=case.temperature,
        with_entropy=True,
        stats=TOKEN_STATS,
        mask=mask,
        backend=backend,
        **TRANSFORMS[transform],
    )
    assert set(ours) == {"logp", "entropy", *TOKEN_STATS}
    assert launches == {backend: 1}
    assert_stats(ours, z, targets, mask, dtype)
    if case.name != "extreme_logits":
        assert ours["is_top1"].any()


@pytest.mark.parametrize("backend", STATS_BACKENDS)
def test_stats_leave_logp_and_its_gradient_unchanged(backend):
    inputs = make_inputs(Case("temperature", temperature=0.7), torch.float32, DEVICE)
    results = []
    for stats in ((), ("is_top1", "log_sum_sq_probs")):
        logits = inputs["logits"].detach().clone().requires_grad_()
        kwargs = dict(temperature=0.7, with_entropy=True, stats=stats, mask=inputs["mask"], backend=backend)
        out = gk.token_logprobs(logits, inputs["targets"], **kwargs)
        logp, ent = (out["logp"], out["entropy"]) if stats else out
        (logp.sum() + 0.3 * ent.sum()).backward()
        results.append((logp, ent, logits.grad))
        if stats:
            assert set(out) == {"logp", "entropy", *stats}
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", STATS_BACKENDS)
def test_packed_rows_and_a_single_stat(backend):
    """[N, V] logits give [N] statistics; asking for one statistic gives just it (and logp)."""
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    B, T, V = inputs["logits"].shape
    out = gk.token_logprobs(
        inputs["logits"].reshape(B * T, V),
        inputs["targets"].reshape(-1),
        stats=["mean_logits"],
        mask=inputs["mask"].reshape(-1),
        backend=backend,
    )
    assert set(out) == {"logp", "mean_logits"} and out["mean_logits"].shape == (B * T,)
    z = oracle_logits(inputs["logits"]).detach().reshape(B * T, V)
    expected = expected_stats(z, inputs["targets"].reshape(-1).cpu(), inputs["mask"].reshape(-1).cpu())
    assert_close(out["mean_logits"], expected["mean_logits"], torch.float32, "mean_logits")


B, T, H, V = 3, 5, 16, 37
CHUNK = 3


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("backend", STATS_BACKENDS)
def test_fused_linear_stats_match_formulas(backend, dtype, transform):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[-1] = False
    logits = hidden.detach().double() @ weight.detach().double().T + bias.double()  # [B, T, V]
    targets = torch.where(torch.arange(T) % 2 == 0, logits.argmax(-1), torch.randint(0, V, (B, T), generator=g))
    out = gk.fused_linear_token_logprobs(
        hidden.to(DEVICE),
        weight.to(DEVICE),
        targets.to(DEVICE),
        bias=bias.to(DEVICE),
        temperature=0.8,
        stats=TOKEN_STATS,
        mask=mask.to(DEVICE),
        chunk_size=CHUNK,
        backend=backend,
        **TRANSFORMS[transform],
    )
    assert set(out) == {"logp", *TOKEN_STATS}
    assert_stats(out, transformed(logits, 0.8, **TRANSFORMS[transform]), targets, mask, dtype)
    out["logp"].sum().backward()  # logp stays differentiable next to the statistics
    assert hidden.grad is not None and weight.grad is not None


# --- checks ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stats,error,message",
    [
        (("entropy",), ValueError, "stats must be names from"),
        (("is_top1", "top5"), ValueError, r"\['top5'\]"),
        ("is_top1", TypeError, "stats must be a sequence of names"),
    ],
)
def test_bad_stats_raise_before_any_launch(stats, error, message, launches):
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    with pytest.raises(error, match=message):
        gk.token_logprobs(inputs["logits"], inputs["targets"], stats=stats, mask=inputs["mask"])
    with pytest.raises(error, match=message):
        gk.fused_linear_token_logprobs(
            torch.randn(4, H), torch.randn(V, H), torch.zeros(4, dtype=torch.long), stats=stats
        )
    assert not launches


def test_cuda_backend_refuses_stats():
    """The CUDA backend computes no statistics: asking is an error at the check and at its launcher."""
    with pytest.raises(ValueError, match=r"not backend='cuda'"):
        validate.check_stats(("is_top1",), "cuda")
    assert validate.check_stats(("is_top1", "is_top1", "mean_logits"), "triton") == ("is_top1", "mean_logits")
    logits = torch.zeros(1, 2, 5)
    ids, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="backend='cuda' does not compute"):
        cuda.token_logprobs_fwd(VocabPassArgs(logits=logits, targets=ids, mask=mask, stats=("mean_logits",)))

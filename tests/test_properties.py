"""Property tests (hypothesis) of grpo_loss over random shapes, dtypes, loss options, masks and optional inputs:
it matches the oracle, stays finite with masked rows' gradient exactly 0, gives 0 on a fully masked batch, and
the torch and triton backends agree. Tensors come from a drawn seed (torch.Generator), not hypothesis arrays.
"""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.options import (
    CLIPPED_SURROGATE_TYPES,
    DPPO_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    TOKEN_LEVEL_ONLY_TYPES,
)
from tests.conftest import DEVICE, DTYPES, RTOL, assert_close
from tests.helpers import oracle_logits

MAX_SHAPE = {"torch": (4, 6, 300), "triton": (3, 4, 130)}  # max (B, T, V); Triton is interpreted on CPU
TORCH = settings(max_examples=25, deadline=None)
TRITON = settings(max_examples=10, deadline=None)
# Multiples of 1/8: the quantile's position (n − 1)·(1 − q) is then exact in float32 and float64 alike, so the
# entropy threshold cannot land on a token in one precision and beside it in the other.
QUANTILES = st.one_of(st.just(1.0), st.integers(1, 7).map(lambda k: k / 8))


@st.composite
def cases(draw, backend: str, extreme: bool = False) -> dict:
    """One grpo_loss call: shape, dtype, seed, logit scale, mask density, optional inputs and valid loss options.

    `extreme`: logits up to ±1e4 with -inf entries (never the target), for the finiteness property only; the
    oracle comparisons keep scales where float32 entropies do not collapse to exact ties at 0.
    """
    max_b, max_t, max_v = MAX_SHAPE[backend]
    T = draw(st.integers(1, max_t))
    loss_type = draw(st.sampled_from(gk.LOSS_TYPES))
    epsilon = draw(st.floats(0.0, 0.4))
    # cispo's epsilon_high is an absolute cap on the IS weight, the others' a width above 1
    epsilon_high = draw(st.floats(0.5, 5.0) if loss_type == "cispo" else st.none() | st.floats(0.0, 0.5))
    token_only = loss_type in TOKEN_LEVEL_ONLY_TYPES  # they form their own sequence weight
    level = "token" if token_only else draw(st.sampled_from(IMPORTANCE_SAMPLING_LEVELS))
    options = {
        "loss_type": loss_type,
        "epsilon": epsilon,
        "epsilon_high": epsilon_high,
        "importance_sampling_level": level,
        "temperature": draw(st.floats(0.5, 2.0)),
        "beta": draw(st.sampled_from((0.0, 0.04, 0.5))),
        "top_entropy_quantile": draw(QUANTILES),
    }
    if options["beta"]:
        options["use_bias_correction_kl"] = draw(st.booleans())
        options["kl_estimator"] = draw(st.sampled_from(KL_ESTIMATORS))
    if loss_type in CLIPPED_SURROGATE_TYPES and draw(st.booleans()):
        options["delta"] = 1.0 + (epsilon if epsilon_high is None else epsilon_high) + draw(st.floats(0.01, 1.0))
    if loss_type in CLIPPED_SURROGATE_TYPES and draw(st.booleans()):
        options["clip_ratio_c"] = draw(st.floats(1.05, 4.0))
    if loss_type == "cispo":
        options["cispo_two_sided"] = draw(st.booleans())
    if loss_type in DPPO_TYPES and draw(st.booleans()):
        options["clip_ratio_c"] = draw(st.floats(0.5, 4.0))  # the truncation cap of the IS weight
    if loss_type == "dro":
        options["dro_beta"] = draw(st.floats(0.01, 2.0))
    if loss_type == "clip_cov":  # every candidate cut: ours and the oracle draw no differing random tokens
        options["clip_cov_ratio"] = 1.0
    options["entropy_coef"] = draw(st.sampled_from((0.0, 0.1)))
    options["loss_agg_mode"] = draw(st.none() | st.sampled_from(LOSS_AGG_MODES))
    if loss_type == "dr_grpo":
        options["max_completion_length"] = T + draw(st.integers(0, 3))
    if loss_type in ("dapo", "cispo", "vespo"):
        options["num_items_in_batch"] = draw(st.none() | st.integers(1, 40))
    return {
        "shape": (draw(st.integers(1, max_b)), T, draw(st.integers(1, max_v))),
        "dtype": draw(st.sampled_from(DTYPES)),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "scale": draw(st.sampled_from((1.0, 1e4)) if extreme else st.floats(0.5, 4.0)),
        "extreme": extreme,
        "keep": draw(st.floats(0.0, 1.0)),  # mask density; 0 gives an all-zero mask
        "on_policy": draw(st.booleans()),
        "per_token_advantages": draw(st.booleans()),
        "is_ratio": draw(st.sampled_from((None, "sequence", "token"))),
        "options": options,
    }


def build(case: dict) -> dict:
    """The tensors of a case. old/ref log-probs are the oracle's log-probs + 0.3·N(0, 1), so ratios stay near 1;
    masked rows of logits hold NaN, so a kernel that reads them poisons its output."""
    g = torch.Generator().manual_seed(case["seed"])
    B, T, V = case["shape"]
    logits = torch.randn(B, T, V, generator=g) * case["scale"]
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < case["keep"]
    if case["extreme"]:
        ninf = torch.rand(B, T, V, generator=g) < 0.3
        logits[ninf.scatter_(-1, targets[..., None], False)] = float("-inf")
    logits = logits.to(case["dtype"])
    logp, _ = reference.token_logprobs(logits.double(), targets, temperature=case["options"]["temperature"])
    near_logp = lambda: (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    inputs = {
        "targets": targets,
        "advantages": torch.randn((B, T) if case["per_token_advantages"] else (B,), generator=g),
        "old_logp": None if case["on_policy"] else near_logp(),
        "ref_logp": near_logp() if case["options"]["beta"] else None,
        "mask": mask,
    }
    if case["is_ratio"]:
        inputs["is_ratio"] = torch.exp(0.2 * torch.randn((B, T) if case["is_ratio"] == "token" else (B,), generator=g))
    logits[~mask] = float("nan")
    inputs["logits"] = logits
    return {k: None if v is None else v.to(DEVICE) for k, v in inputs.items()}


def run(inputs: dict, backend: str, options: dict) -> tuple[gk.GRPOLossOutput, torch.Tensor]:
    """Our loss and its logits gradient, on a copy of the logits (the in-place backward overwrites them)."""
    logits = inputs["logits"].clone().requires_grad_()
    args = {k: v for k, v in inputs.items() if k != "logits"}
    out = gk.grpo_loss(logits, **args, backend=backend, with_entropy=True, **options)
    out.loss.backward()
    return out, logits.grad


def oracle(inputs: dict, options: dict, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle's loss and logits gradient at `logits` (float64), with the rest of `inputs`."""
    logits = logits.detach().requires_grad_()
    args = {k: v.cpu() for k, v in inputs.items() if k != "logits" and v is not None}
    loss, _ = reference.grpo_loss(logits, **args, **options)
    loss.backward()
    return loss.detach(), logits.grad


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """assert_close's measure: max |actual − expected| over max(max |expected|, 1e-6)."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-6))


def well_conditioned_oracle(case: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's (loss, grad), after assume()-ing float32 can resolve them to a quarter of the dtype's tolerance.

    Where it cannot, the exact answer is ~0 by cancellation and no float32 implementation, however correct, meets
    the tolerance. Two float32 roundings are modelled, each at 4 units (2⁻²⁴ relative):
    - of the log-probs, which moves log-ratios and KL terms as an error in old_logp/ref_logp would (a KL-only
      gradient with ref_logp ≈ logp, a loss summing terms of both signs): the oracle reruns on jittered logits,
      old_logp and ref_logp and must barely move;
    - of p_t in a backward's target entry g·(1 − p_t) (torch's log_softmax backward rounds the same way), which
      is off by |g|·p_t·2⁻²⁴ = |grad_t|·p_t / (1 − p_t)·2⁻²⁴ when p_t → 1.
    """
    g = torch.Generator().manual_seed(case["seed"])
    unit = 4 * 2.0**-24

    def jitter(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.detach().cpu().double() * (1 + unit * (2 * torch.rand(t.shape, generator=g, dtype=torch.float64) - 1))

    x = oracle_logits(inputs["logits"])
    loss, grad = oracle(inputs, case["options"], x)
    moved = oracle(
        {**inputs, "old_logp": jitter(inputs["old_logp"]), "ref_logp": jitter(inputs["ref_logp"])},
        case["options"],
        jitter(x),
    )
    targets = inputs["targets"].cpu()
    logp, _ = reference.token_logprobs(x.detach(), targets, temperature=case["options"]["temperature"])
    grad_t = grad.gather(-1, targets[..., None]).squeeze(-1).abs()
    softmax_error = unit * (grad_t * logp.exp() / -torch.expm1(logp)).nan_to_num(nan=0.0, posinf=0.0).max()
    tolerance = RTOL[case["dtype"]] / 4
    assume(scaled_error(moved[0], loss) < tolerance and scaled_error(moved[1], grad) < tolerance)
    assume(float(softmax_error / grad.abs().max().clamp(min=1e-6)) < tolerance)
    if case["options"]["loss_type"] == "kl_cov":
        assume(kl_cov_selection_is_clear(inputs, logp, case["options"]))
    return loss, grad


def kl_cov_selection_is_clear(inputs: dict, logp: torch.Tensor, options: dict) -> bool:
    """Whether kl_cov's k tokens of largest covariance (`torch.topk`) stand clear of the next one by more than a
    float32 rounding can move them (1e-4 of the largest |covariance|). Where they do not, float32 and float64 may
    pick different tokens and neither is wrong: with two kept tokens the covariances tie exactly."""
    keep = inputs["mask"].cpu()
    adv = inputs["advantages"].cpu().double()
    adv = (adv if adv.dim() == 2 else adv[:, None]).expand(keep.shape)[keep]  # [M]
    kept = logp[keep]  # [M]
    cov = ((adv - adv.mean()) * (kept - kept.mean())).sort(descending=True).values  # [M]
    k = max(int(cov.numel() * options.get("kl_cov_ratio", 0.0002)), 1)
    if cov.numel() <= k:
        return True
    return bool(cov[k - 1] - cov[k] > 1e-4 * cov.abs().max())


def check_matches_oracle(case: dict, backend: str) -> None:
    inputs = build(case)
    ref_loss, ref_grad = well_conditioned_oracle(case, inputs)
    out, grad = run(inputs, backend, case["options"])
    assert_close(out.loss, ref_loss, case["dtype"], "loss")
    assert_close(grad, ref_grad, case["dtype"], "grad logits")


@TORCH
@given(case=cases("torch"))
def test_torch_matches_oracle(case):
    check_matches_oracle(case, "torch")


@TRITON
@given(case=cases("triton"))
def test_triton_matches_oracle(case):
    check_matches_oracle(case, "triton")


def assert_finite_metrics(metrics: dict[str, torch.Tensor]) -> None:
    bad = {name: value.item() for name, value in metrics.items() if not torch.isfinite(value)}
    assert not bad, f"non-finite metrics {bad}"


def check_finite_and_masked_rows_zero(case: dict, backend: str) -> None:
    inputs = build(case)
    out, grad = run(inputs, backend, case["options"])
    assert torch.isfinite(out.loss), f"loss {out.loss}"
    assert_finite_metrics(out.metrics)
    assert torch.isfinite(grad).all(), "non-finite gradient"
    assert torch.count_nonzero(grad[~inputs["mask"]]) == 0, "masked rows have a gradient"


@TORCH
@given(case=cases("torch", extreme=True))
def test_torch_finite_and_masked_rows_zero(case):
    check_finite_and_masked_rows_zero(case, "torch")


@TRITON
@given(case=cases("triton", extreme=True))
def test_triton_finite_and_masked_rows_zero(case):
    check_finite_and_masked_rows_zero(case, "triton")


def check_fully_masked_batch(case: dict, backend: str) -> None:
    out, grad = run(build({**case, "keep": 0.0}), backend, case["options"])
    assert out.loss.item() == 0.0, f"loss {out.loss}"
    assert_finite_metrics(out.metrics)
    assert torch.count_nonzero(grad) == 0, "a fully masked batch has a gradient"


@TORCH
@given(case=cases("torch"))
def test_torch_fully_masked_batch(case):
    check_fully_masked_batch(case, "torch")


@TRITON
@given(case=cases("triton"))
def test_triton_fully_masked_batch(case):
    check_fully_masked_batch(case, "triton")


@TRITON
@given(case=cases("triton"))
def test_backends_agree(case):
    inputs = build(case)
    well_conditioned_oracle(case, inputs)  # two float32 computations differ by what the oracle is sensitive to
    (out, grad), (ref_out, ref_grad) = (run(inputs, backend, case["options"]) for backend in ("triton", "torch"))
    assert_close(out.loss, ref_out.loss, case["dtype"], "loss")
    assert_close(grad, ref_grad, case["dtype"], "grad logits")

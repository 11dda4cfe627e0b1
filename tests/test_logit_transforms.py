"""Logit scaling and soft-capping (TRL's order: z = c·tanh(s·x/c), then / temperature) in the vocabulary pass,
against the float64 oracle: every backend x dtype x hard case, logp, entropy and dL/dlogits; the fused lm_head;
grpo_loss and fused_linear_grpo_loss, on the fused-epilogue and the two-phase paths."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels.torch import token_logprobs as token_logprobs_torch
from tests.cases import CASE_IDS, CASES, Case, make_inputs
from tests.conftest import BACKENDS, DEVICE, DTYPES, assert_close
from tests.helpers import (
    TRITON_INTERPRETED,
    interpreted_cells,
    kernel_forms_loss,
    loss_inputs,
    oracle_logits,
    ours_and_oracle,
)

# name -> (logit_scale, final_logit_softcapping); the cases' logits are ~N(0, 2²), so a cap of 3 bends them
TRANSFORMS = {
    "scaled": dict(logit_scale=0.6),
    "softcapped": dict(final_logit_softcapping=3.0),
    "scaled_softcapped": dict(logit_scale=1.7, final_logit_softcapping=2.5),
}


def weighted_grad(logits, targets, mask, temperature, transform, backend, inplace=True):
    """(logp, entropy, dL/dlogits) of L = Σ w·logp + Σ w_H·H for fixed random weights, and the oracle's."""
    g = torch.Generator().manual_seed(7)
    w_logp, w_ent = torch.randn(2, *mask.shape, generator=g).to(logits.device)
    ref_logits = oracle_logits(logits)  # before the in-place backward overwrites the logits
    logits = logits.detach().requires_grad_()
    logp, ent = gk.token_logprobs(
        logits,
        targets,
        temperature=temperature,
        with_entropy=True,
        mask=mask,
        backend=backend,
        inplace=inplace,
        **transform,
    )
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    m = mask.cpu().double()
    ref_logp, ref_ent = reference.token_logprobs(ref_logits, targets.cpu(), temperature=temperature, **transform)
    ((ref_logp * m * w_logp.cpu()).sum() + (ref_ent * m * w_ent.cpu()).sum()).backward()
    return (logp, ent, logits.grad), (ref_logp * m, ref_ent * m, ref_logits.grad)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, case, transform, launches):
    inputs = make_inputs(case, dtype, DEVICE)
    ours, oracle = weighted_grad(
        inputs["logits"], inputs["targets"], inputs["mask"], case.temperature, TRANSFORMS[transform], backend
    )
    assert launches[backend] == 2 and sum(launches.values()) == 2
    assert ours[2].dtype == dtype
    for name, x, ref in zip(("logp", "entropy", "grad logits"), ours, oracle, strict=True):
        assert_close(x, ref, dtype, name)


@pytest.mark.parametrize("inplace", (True, False))
@pytest.mark.parametrize("window_rows", (1, 4))
@pytest.mark.parametrize("case", [Case("neg_inf_logits"), Case("non_contiguous"), Case("temperature", temperature=0.7)])
def test_torch_windows_and_out_of_place(case, window_rows, inplace, monkeypatch):
    """The torch backend's windows (straddling NaN-filled masked rows, cut at a strided sequence's end), in place
    and into a new buffer, with soft-capping."""
    for device_kind in token_logprobs_torch.CHUNK_ELEMENTS:
        monkeypatch.setitem(token_logprobs_torch.CHUNK_ELEMENTS, device_kind, window_rows * case.V)
    inputs = make_inputs(case, torch.float32, DEVICE)
    transform = TRANSFORMS["scaled_softcapped"]
    ours, oracle = weighted_grad(
        inputs["logits"], inputs["targets"], inputs["mask"], case.temperature, transform, "torch", inplace
    )
    for name, x, ref in zip(("logp", "entropy", "grad logits"), ours, oracle, strict=True):
        assert_close(x, ref, torch.float32, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_applies_the_tanh_derivative(backend):
    """The gradient is s/T·(1 − tanh²(s·x/c)) times the gradient w.r.t. the capped logits: the same expression
    without the tanh factor is far off here (|s·x/c| ~ 1), so a backward that drops it fails."""
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    transform, temperature = TRANSFORMS["scaled_softcapped"], 0.8
    (_, _, grad), (_, _, ref_grad) = weighted_grad(
        inputs["logits"], inputs["targets"], inputs["mask"], temperature, transform, backend
    )
    assert_close(grad, ref_grad, torch.float32, "grad logits")
    x = oracle_logits(inputs["logits"]).detach()
    tanh = torch.tanh(transform["logit_scale"] * x / transform["final_logit_softcapping"])
    without_tanh_factor = ref_grad / (1 - tanh**2)  # what a backward ignoring the tanh derivative would give
    assert (without_tanh_factor - grad.double().cpu()).abs().max() > 0.1 * ref_grad.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_transform_is_the_plain_pass(backend):
    inputs = make_inputs(Case("temperature", temperature=0.7), torch.float32, DEVICE)
    args = (inputs["logits"], inputs["targets"])
    kwargs = dict(temperature=0.7, with_entropy=True, mask=inputs["mask"], backend=backend)
    plain = gk.token_logprobs(*args, **kwargs)
    explicit = gk.token_logprobs(*args, **kwargs, logit_scale=1.0, final_logit_softcapping=None)
    for x, y in zip(plain, explicit, strict=True):
        assert torch.equal(x, y)


# --- the fused lm_head ----------------------------------------------------------------------------------------------

B, T, H, V = 3, 5, 16, 37
CHUNK = 3  # kept rows per chunk: not a divisor of the kept-token count


def linear_inputs(dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[-1] = False  # a fully masked sequence
    inputs = {
        "hidden": torch.randn(B, T, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / H**0.5 * 3,  # logits ~ N(0, 3²): well into the cap's bend
        "bias": torch.randn(V, generator=g),
        "targets": torch.randint(0, V, (B, T), generator=g),
        "mask": mask,
    }
    return {k: v.to(dtype).to(DEVICE) if v.is_floating_point() else v.to(DEVICE) for k, v in inputs.items()}


def linear_leaves(inputs: dict, double: bool) -> dict:
    return {
        k: (inputs[k].double().cpu() if double else inputs[k]).detach().clone().requires_grad_()
        for k in ("hidden", "weight", "bias")
    }


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_logprobs_match_reference(backend, dtype, transform, launches):
    inputs = linear_inputs(dtype)
    p = linear_leaves(inputs, double=False)
    logp, ent = gk.fused_linear_token_logprobs(
        p["hidden"],
        p["weight"],
        inputs["targets"],
        bias=p["bias"],
        temperature=0.9,
        with_entropy=True,
        mask=inputs["mask"],
        chunk_size=CHUNK,
        backend=backend,
        **TRANSFORMS[transform],
    )
    (logp.sum() - 0.5 * ent.sum()).backward()
    assert launches[backend] == 2 * -(-int(inputs["mask"].sum()) // CHUNK)

    r = linear_leaves(inputs, double=True)
    logits = r["hidden"] @ r["weight"].T + r["bias"]
    m = inputs["mask"].cpu().double()
    ref_logp, ref_ent = reference.token_logprobs(
        logits, inputs["targets"].cpu(), temperature=0.9, **TRANSFORMS[transform]
    )
    ((ref_logp * m).sum() - 0.5 * (ref_ent * m).sum()).backward()
    assert_close(logp, ref_logp * m, dtype, "logp")
    assert_close(ent, ref_ent * m, dtype, "entropy")
    for name in ("hidden", "weight", "bias"):
        assert p[name].grad.dtype == dtype
        assert_close(p[name].grad, r[name].grad, dtype, f"grad {name}")


# --- the loss -------------------------------------------------------------------------------------------------------

LOSS_OPTIONS = {  # token-level (the fused epilogue on triton / cuda, 3 GEMMs fused-linear) and sequence-level
    "dapo_k3": dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "entropy_bonus": dict(loss_type="dapo", entropy_coef=0.1),
}


LOSS_CASES = [Case("ragged_vocab"), Case("neg_inf_logits"), Case("extreme_logits", scale=1e4)]
LOSS_CELLS = [
    (loss, (dtype, case)) for dtype in (torch.float32, torch.bfloat16) for case in LOSS_CASES for loss in LOSS_OPTIONS
]


def loss_fused(loss: str) -> bool:
    return kernel_forms_loss("triton", **LOSS_OPTIONS[loss], **TRANSFORMS["scaled_softcapped"])


# Under the interpreter Triton runs `interpreted_cells`: the fused-epilogue losses on every dtype x case, the
# two-phase ones once (the soft-capped pass itself, with entropy gradients, is test_matches_reference's)
SOFTCAP_LOSS_CELLS = [
    (backend, dtype, case, loss)
    for backend in BACKENDS
    for loss, (dtype, case) in (
        interpreted_cells(LOSS_CELLS, lambda loss, _: loss_fused(loss))
        if backend == "triton" and TRITON_INTERPRETED
        else LOSS_CELLS
    )
]


@pytest.mark.parametrize(
    "backend,dtype,case,loss",
    SOFTCAP_LOSS_CELLS,
    ids=lambda x: x.name if isinstance(x, Case) else str(x).removeprefix("torch."),
)
def test_grpo_loss_with_softcap_matches_reference(backend, dtype, case, loss, launches):
    options = LOSS_OPTIONS[loss] | TRANSFORMS["scaled_softcapped"]
    ours, oracle = ours_and_oracle(loss_inputs(case, dtype, DEVICE), backend, temperature=0.9, **options)
    for name, x, ref in zip(("loss", "grad logits"), (ours[0], ours[2]), (oracle[0], oracle[2]), strict=True):
        assert_close(x, ref, dtype, name)
    for name, value in ours[1].items():
        assert_close(value, oracle[1][name], dtype, name)
    fused = loss in ("dapo_k3", "cispo")  # every backend has a fused epilogue
    assert fused == kernel_forms_loss(backend, **LOSS_OPTIONS[loss], **TRANSFORMS["scaled_softcapped"])
    assert launches["fused_epilogue"] == int(fused)


@pytest.mark.parametrize("loss", LOSS_OPTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_grpo_loss_with_softcap_matches_reference(backend, loss, launches):
    options = LOSS_OPTIONS[loss] | TRANSFORMS["scaled_softcapped"]
    inputs = linear_inputs(torch.float32)
    g = torch.Generator().manual_seed(3)
    p = linear_leaves(inputs, double=False)
    args = dict(
        advantages=torch.randn(B, generator=g).to(DEVICE),
        old_logp=(-3.0 + 0.5 * torch.randn(B, T, generator=g)).to(DEVICE),
        ref_logp=(-3.0 + 0.5 * torch.randn(B, T, generator=g)).to(DEVICE),
        mask=inputs["mask"],
    )
    out = gk.fused_linear_grpo_loss(
        p["hidden"],
        p["weight"],
        inputs["targets"],
        **args,
        bias=p["bias"],
        chunk_size=CHUNK,
        backend=backend,
        temperature=0.9,
        **options,
    )
    out.loss.backward()
    token_level = loss in ("dapo_k3", "cispo", "entropy_bonus")
    assert launches["fused_linear_token_loss"] == int(token_level)

    r = linear_leaves(inputs, double=True)
    logits = r["hidden"] @ r["weight"].T + r["bias"]
    cpu = {k: v.cpu() for k, v in args.items()}
    ref_loss, ref_metrics = reference.grpo_loss(logits, inputs["targets"].cpu(), **cpu, temperature=0.9, **options)
    ref_loss.backward()
    assert_close(out.loss, ref_loss, torch.float32, "loss")
    for name, value in out.metrics.items():
        assert_close(value, ref_metrics[name], torch.float32, name)
    for name in ("hidden", "weight", "bias"):
        assert_close(p[name].grad, r[name].grad, torch.float32, f"grad {name}")


# --- checks ---------------------------------------------------------------------------------------------------------

BAD = {
    "zero_scale": (dict(logit_scale=0.0), "logit_scale must be > 0"),
    "negative_scale": (dict(logit_scale=-1.0), "logit_scale must be > 0"),
    "nan_scale": (dict(logit_scale=float("nan")), "logit_scale must be > 0"),
    "zero_cap": (dict(final_logit_softcapping=0.0), "final_logit_softcapping must be > 0"),
    "negative_cap": (dict(final_logit_softcapping=-30.0), "final_logit_softcapping must be > 0"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_transform_raises_before_any_launch(bad, launches):
    kwargs, message = BAD[bad]
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    with pytest.raises(ValueError, match=message):
        gk.token_logprobs(inputs["logits"], inputs["targets"], mask=inputs["mask"], **kwargs)
    linear = linear_inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        gk.fused_linear_token_logprobs(linear["hidden"], linear["weight"], linear["targets"], **kwargs)
    with pytest.raises(ValueError, match=message):
        gk.grpo_loss(inputs["logits"], inputs["targets"], torch.zeros(inputs["targets"].shape[0]), **kwargs)
    assert not launches

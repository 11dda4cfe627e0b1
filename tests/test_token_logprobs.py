"""token_logprobs against the float64 oracle: every backend x dtype x hard case, values and gradients."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels.torch import token_logprobs as token_logprobs_torch
from tests.cases import CASE_IDS, CASES, Case, make_inputs
from tests.conftest import BACKENDS, DEVICE, DTYPES, assert_close
from tests.helpers import oracle_logits


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, case, launches):
    inputs = make_inputs(case, dtype, DEVICE)
    logits, targets, mask = inputs["logits"].requires_grad_(), inputs["targets"], inputs["mask"]
    g = torch.Generator().manual_seed(7)
    w_logp, w_ent = torch.randn(2, *mask.shape, generator=g).to(DEVICE)
    ref_logits = oracle_logits(logits)  # before the in-place backward overwrites the logits

    logp, ent = gk.token_logprobs(
        logits, targets, temperature=case.temperature, with_entropy=True, mask=mask, backend=backend
    )
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    assert launches[backend] == 2 and sum(launches.values()) == 2
    assert logp.dtype == ent.dtype == torch.float32
    assert logits.grad.dtype == dtype and logits.grad.shape == logits.shape
    assert torch.equal(logits.detach(), logits.grad), "the in-place backward leaves the gradient in the logits"

    m = mask.cpu().double()
    ref_logp, ref_ent = reference.token_logprobs(ref_logits, targets.cpu(), temperature=case.temperature)
    ((ref_logp * m * w_logp.cpu()).sum() + (ref_ent * m * w_ent.cpu()).sum()).backward()
    assert_close(logp, ref_logp * m, dtype, "logp")
    assert_close(ent, ref_ent * m, dtype, "entropy")
    assert_close(logits.grad, ref_logits.grad, dtype, "grad logits")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("window_rows", (1, 2, 4))
def test_torch_windows_match_reference(window_rows, dtype, case, monkeypatch, launches):
    """The torch backend in windows of a few rows (windows that straddle masked rows full of NaN, windows cut
    at a sequence's end for strided logits) matches the oracle too."""
    for device_kind in token_logprobs_torch.CHUNK_ELEMENTS:
        monkeypatch.setitem(token_logprobs_torch.CHUNK_ELEMENTS, device_kind, window_rows * case.V)
    test_matches_reference("torch", dtype, case, launches)


@pytest.mark.parametrize("backend", BACKENDS)
def test_not_inplace_keeps_logits_and_allows_two_backwards(backend):
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    logits = inputs["logits"].requires_grad_()
    before = logits.detach().clone()
    logp = gk.token_logprobs(logits, inputs["targets"], mask=inputs["mask"], inplace=False, backend=backend)
    logp.sum().backward(retain_graph=True)
    first = logits.grad.clone()
    logp.sum().backward()
    assert torch.equal(logits.detach().nan_to_num(), before.nan_to_num())
    assert_close(logits.grad, 2 * first, torch.float32, "twice the gradient")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_second_backward_is_an_error(backend):
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    logits = inputs["logits"].requires_grad_()
    logp = gk.token_logprobs(logits, inputs["targets"], mask=inputs["mask"], backend=backend)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace=False"):
        logp.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_only_gradient_and_packed_rows(backend):
    """Gradient through the entropy alone; [N, V] logits (no batch dim) give the same as [1, N, V]."""
    inputs = make_inputs(Case("temperature", temperature=0.7), torch.float32, DEVICE)
    B, T, V = inputs["logits"].shape
    flat = inputs["logits"].reshape(B * T, V).requires_grad_()
    ref_logits = oracle_logits(inputs["logits"]).reshape(B * T, V).detach().requires_grad_()
    logp, ent = gk.token_logprobs(
        flat,
        inputs["targets"].reshape(-1),
        temperature=0.7,
        with_entropy=True,
        mask=inputs["mask"].reshape(-1),
        backend=backend,
    )
    ent.sum().backward()
    assert logp.shape == ent.shape == (B * T,)
    _, ref_ent = reference.token_logprobs(ref_logits, inputs["targets"].reshape(-1).cpu(), temperature=0.7)
    m = inputs["mask"].reshape(-1).cpu().double()
    (ref_ent * m).sum().backward()
    assert_close(ent, ref_ent * m, torch.float32, "entropy")
    assert_close(flat.grad, ref_logits.grad, torch.float32, "grad through entropy")


def test_auto_backend_on_cpu_is_torch(launches):
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, torch.device("cpu"))
    gk.token_logprobs(inputs["logits"], inputs["targets"], mask=inputs["mask"])
    assert launches == {"torch": 1}

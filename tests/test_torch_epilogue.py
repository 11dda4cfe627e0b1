"""The torch backend's fused epilogue (`kernels/torch/grpo_loss.py`: each token's loss and dL/dlogp in closed form)
against the loss algebra of `losses/` it transcribes, run through the same engine on the same float64 inputs: the
call that asks for the per-sequence losses takes the two-phase route (the algebra, differentiated by autograd), the
plain call the fused one. In float64 they agree to a few ulps of the largest term, on every policy kind,
KL estimator and option the epilogue reads, with the hard rows: a -inf logit, NaN and inf at padding, log-ratios
past the ±20 clamp, a KL past low_var_kl's ±10, ties of the clip's min. The fused lm_head's chunks use the same
closed form, held to the algebra the same way (loss, dL/dhidden and dL/dweight).
"""

from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk

B, T, V = 3, 7, 11
F64 = torch.float64

OPTIONS = {
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "grpo_delta": dict(loss_type="grpo", delta=1.2, epsilon=0.05),
    "grpo_dual_clip": dict(loss_type="grpo", clip_ratio_c=3.0, epsilon=0.05),
    "bnpo_is_ratio": dict(loss_type="bnpo", is_ratio=True),
    "luspo": dict(loss_type="luspo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),
    "cispo_two_sided": dict(loss_type="cispo", cispo_two_sided=True),
    "sapo": dict(loss_type="sapo"),
    "gpg": dict(loss_type="gpg"),
    "bias_corrected_kl": dict(loss_type="dapo", use_bias_correction_kl=True),
    "on_policy_ties": dict(loss_type="grpo", on_policy=True, epsilon=0.0, epsilon_high=0.0, delta=1.0),
}
KL = [(0.0, "k3"), (0.1, "k1"), (0.1, "k2"), (0.1, "k3"), (0.1, "low_var_kl")]


def _inputs(on_policy: bool, is_ratio: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g, dtype=F64) * 3
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[2, 1:] = False
    logits[0, 2], targets[0, 2], mask[0, 2] = -math.inf, 1, True  # a row of -inf but its target
    logits[0, 2, 1] = 0.0
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old[1, 0], mask[1, 0] = old[1, 0] + 25.0, True  # a log-ratio past the clamp
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref[1, 1], mask[1, 1] = ref[1, 1] + 5.0, True  # k3 past low_var_kl's clamp
    padding = ~mask
    old[padding], ref[padding] = math.nan, math.inf  # padding holds anything
    x = dict(logits=logits, targets=targets, mask=mask, advantages=torch.randn(B, generator=g, dtype=F64))
    x |= dict(old_logp=None if on_policy else old, ref_logp=ref)
    if is_ratio:
        x["is_ratio"] = torch.rand(B, T, generator=g, dtype=F64) + 0.5
    return x


def _loss_and_grad(x: dict, options: dict, two_phase: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = x["logits"].clone().requires_grad_()
    args = (logits, x["targets"], x["advantages"], x["old_logp"], x["ref_logp"], x["mask"])
    out = gk.grpo_loss(*args, is_ratio=x.get("is_ratio"), backend="torch", return_sequence_losses=two_phase, **options)
    loss = out[0].loss if two_phase else out.loss
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("beta,kl_estimator", KL, ids=[f"{b}-{k}" for b, k in KL])
@pytest.mark.parametrize("name", OPTIONS)
def test_epilogue_matches_the_algebra(name, beta, kl_estimator, launches):
    options = dict(OPTIONS[name])
    x = _inputs(options.pop("on_policy", False), options.pop("is_ratio", False))
    options |= dict(beta=beta, kl_estimator=kl_estimator, max_completion_length=T)
    fused = _loss_and_grad(x, options, two_phase=False)
    assert launches["fused_epilogue"] == 1, "not the fused route"
    algebra = _loss_and_grad(x, options, two_phase=True)
    assert launches["fused_epilogue"] == 1, "not the two-phase route"
    assert torch.isfinite(fused[0]) and torch.isfinite(fused[1]).all()
    for ours, spec, what in zip(fused, algebra, ("loss", "dL/dlogits"), strict=True):
        scale = spec.abs().max().item()  # a few ulps of the largest term (k3 past its clamp is e^5)
        message = lambda m, what=what: f"{name}, {what}: {m}"  # noqa: E731
        torch.testing.assert_close(ours, spec, rtol=1e-12, atol=1e-13 * scale, msg=message)


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "padding"])
def test_unchecked_nonfinite_input(kept, launches):
    """With the checks off, a NaN old log-prob at a kept token makes the loss NaN on both routes; at padding it
    changes nothing."""
    x = _inputs(on_policy=False, is_ratio=False)
    position = (0, 0) if kept else (2, 3)
    x["mask"][position] = kept
    x["old_logp"][position] = math.nan
    options = dict(loss_type="dapo", beta=0.1, check_finite=False)
    fused, algebra = (_loss_and_grad(x, options, two_phase) for two_phase in (False, True))
    assert launches["fused_epilogue"] == 1
    assert math.isnan(fused[0]) == math.isnan(algebra[0]) == kept


def test_no_gradient_runs_two_phase(launches):
    """Without a gradient to take, the torch backend runs the algebra (fewer ops than the epilogue's closed-form
    dL/dlogp, which nothing would read): the same loss and metrics as the fused route."""
    x = _inputs(on_policy=False, is_ratio=False)
    args = (x["targets"], x["advantages"], x["old_logp"], x["ref_logp"], x["mask"])
    options = dict(loss_type="dapo", beta=0.1, backend="torch")
    with torch.no_grad():
        plain = gk.grpo_loss(x["logits"].clone().requires_grad_(), *args, **options)
    assert launches["fused_epilogue"] == 0
    fused = gk.grpo_loss(x["logits"].clone().requires_grad_(), *args, **options)
    assert launches["fused_epilogue"] == 1
    torch.testing.assert_close(plain.loss, fused.loss.detach(), rtol=1e-12, atol=0)
    for name, value in fused.metrics.items():
        torch.testing.assert_close(plain.metrics[name], value, rtol=1e-12, atol=0, msg=name)


H = 5


def _linear_loss_and_grads(x: dict, head: tuple, options: dict, two_phase: bool) -> list[torch.Tensor]:
    hidden, weight = (p.clone().requires_grad_() for p in head)
    args = (hidden, weight, x["targets"], x["advantages"], x["old_logp"], x["ref_logp"], x["mask"])
    out = gk.fused_linear_grpo_loss(
        *args, is_ratio=x.get("is_ratio"), backend="torch", chunk_size=4, return_sequence_losses=two_phase, **options
    )
    loss = out[0].loss if two_phase else out.loss
    loss.backward()
    return [loss.detach(), hidden.grad, weight.grad]


@pytest.mark.parametrize("beta,kl_estimator", KL, ids=[f"{b}-{k}" for b, k in KL])
@pytest.mark.parametrize("name", OPTIONS)
def test_fused_lm_head_chunk_matches_the_algebra(name, beta, kl_estimator, launches):
    """The fused lm_head forms each chunk's dL/dlogp by the same closed form: in float64 its loss and dL/dhidden,
    dL/dweight agree with the two-phase algebra's to a few ulps (chunks of 4 rows, padding holding NaN and inf)."""
    options = dict(OPTIONS[name])
    x = _inputs(options.pop("on_policy", False), options.pop("is_ratio", False))
    g = torch.Generator().manual_seed(1)
    head = (torch.randn(B, T, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64))
    options |= dict(beta=beta, kl_estimator=kl_estimator, max_completion_length=T)
    fused = _linear_loss_and_grads(x, head, options, two_phase=False)
    assert launches["fused_linear_token_loss"] == 1, "not the fused route"
    algebra = _linear_loss_and_grads(x, head, options, two_phase=True)
    assert launches["fused_linear_token_loss"] == 1, "not the two-phase route"
    assert all(torch.isfinite(t).all() for t in fused)
    for ours, spec, what in zip(fused, algebra, ("loss", "dL/dhidden", "dL/dweight"), strict=True):
        scale = spec.abs().max().item()
        message = lambda m, what=what: f"{name}, {what}: {m}"  # noqa: E731
        torch.testing.assert_close(ours, spec, rtol=1e-12, atol=1e-13 * scale, msg=message)

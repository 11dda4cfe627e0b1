"""The kept-set input of sampling replay (`sampling_mask`), checked: an empty kept set where the mask keeps the
position, leading dimensions other than the targets', a meta tensor and a non-finite logit outside the kept set
are each one ValueError naming it; duplicate ids count once; masked positions are never read."""

from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk
from tests.conftest import DEVICE

B, T, V, H = 2, 3, 11, 8


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g).to(DEVICE)
    targets = torch.randint(0, V - 2, (B, T), generator=g).to(DEVICE)
    ids = torch.stack([targets, targets + 1, torch.full_like(targets, -1)], dim=-1)  # [B, T, 3]: two kept, padding
    return logits, targets, ids


def _csr(ids: torch.Tensor) -> gk.SamplingMask:
    flat = ids.reshape(-1, ids.shape[-1])
    counts = (flat >= 0).sum(-1)
    return gk.SamplingMask(flat[flat >= 0], torch.nn.functional.pad(counts.cumsum(0), (1, 0)))


@pytest.mark.parametrize("form", ("padded", "csr"))
def test_an_empty_kept_set_where_the_mask_keeps_the_position_names_it(form):
    logits, targets, ids = _inputs()
    ids[0, 1] = -1  # position (0, 1): nothing kept (CSR: equal offsets)
    kept = ids if form == "padded" else _csr(ids)
    hidden, weight = torch.randn(B, T, H, device=DEVICE), torch.randn(V, H, device=DEVICE)
    calls = (
        lambda **kw: gk.token_logprobs(logits, targets, **kw),
        lambda **kw: gk.fused_linear_token_logprobs(hidden, weight, targets, **kw),
        lambda **kw: gk.grpo_loss(logits, targets, torch.ones(B, device=DEVICE), **kw),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"sampling_mask keeps no token at index \(0, 1\)"):
            call(sampling_mask=kept)
        mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
        mask[0, 1] = False  # masked: never read, so an empty set there is fine
        call(sampling_mask=kept, mask=mask)
    flat = ids.reshape(B * T, -1)
    with pytest.raises(ValueError, match="sampling_mask keeps no token at index 1,"):
        gk.token_logprobs(logits.reshape(B * T, V), targets.reshape(-1), sampling_mask=flat)


def test_duplicate_ids_are_kept_once():
    logits, targets, ids = _inputs(1)
    twice = torch.cat([ids, ids[..., :2]], dim=-1)  # every kept id given twice
    results = []
    for kept in (ids, twice, _csr(twice)):
        x = logits.clone().requires_grad_()
        logp, entropy = gk.token_logprobs(x, targets, with_entropy=True, sampling_mask=kept, inplace=False)
        (logp.sum() + entropy.sum()).backward()
        results.append((logp, entropy, x.grad))
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_leading_dimensions_are_the_targets():
    logits, targets, ids = _inputs()
    for wrong in (ids.transpose(0, 1).contiguous(), ids.reshape(1, B * T, -1)):  # [T, B, K], [1, B·T, K]
        with pytest.raises(ValueError, match=r"sampling_mask must be \[B, T, K\] = \[2, 3, K\]"):
            gk.token_logprobs(logits, targets, sampling_mask=wrong)
    flattened = gk.token_logprobs(logits, targets, sampling_mask=ids.reshape(B * T, -1))  # [B·T, K]: the same order
    torch.testing.assert_close(flattened, gk.token_logprobs(logits, targets, sampling_mask=ids))


def test_a_meta_tensor_names_the_argument():
    logits, targets, ids = _inputs()
    csr = _csr(ids)
    cases = {
        "sampling_mask": ids.to("meta"),
        "sampling_mask.token_ids": gk.SamplingMask(csr.token_ids.to("meta"), csr.offsets),
        "sampling_mask.offsets": gk.SamplingMask(csr.token_ids, csr.offsets.to("meta")),
    }
    for name, kept in cases.items():
        with pytest.raises(ValueError, match=rf"^{name} must hold values, got a tensor on the meta device"):
            gk.token_logprobs(logits, targets, sampling_mask=kept)


@pytest.mark.parametrize("bad", (math.nan, math.inf))
def test_a_non_finite_logit_outside_the_kept_set_is_refused(bad):
    logits, targets, ids = _inputs(2)
    outside = V - 1  # no position keeps it: targets + 1 <= V - 2
    logits[1, 2, outside] = bad
    advantages = torch.ones(B, device=DEVICE)
    where = r"at index \(1, 2\)"
    with pytest.raises(ValueError, match=rf"^logits must have a finite log-sum-exp at kept tokens.*{where}"):
        gk.token_logprobs(logits, targets, sampling_mask=ids)
    with pytest.raises(ValueError, match=rf"^logits must have a finite log-sum-exp at kept tokens.*{where}"):
        gk.grpo_loss(logits, targets, advantages, sampling_mask=_csr(ids))
    for rule in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.1}):  # a rule's thresholds read the whole row
        with pytest.raises(ValueError, match=rf"^logits must have a finite log-sum-exp at kept tokens.*{where}"):
            gk.token_logprobs(logits, targets, **rule)
    hidden = torch.randn(B, T, H, device=DEVICE)
    weight = torch.randn(V, H, device=DEVICE)
    weight[outside] = bad
    linear = r"^hidden @ weight.T \+ bias must have a finite log-sum-exp at kept tokens"
    with pytest.raises(ValueError, match=linear):
        gk.fused_linear_token_logprobs(hidden, weight, targets, sampling_mask=ids)
    with pytest.raises(ValueError, match=linear):
        gk.fused_linear_grpo_loss(hidden, weight, targets, advantages, sampling_mask=ids)
    mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    mask[1, 2] = False  # a masked row is never read
    assert torch.isfinite(gk.token_logprobs(logits, targets, sampling_mask=ids, mask=mask)).all()
    unchecked = gk.token_logprobs(logits, targets, sampling_mask=ids, check_finite=False)  # not read: as asked
    assert unchecked.shape == (B, T)

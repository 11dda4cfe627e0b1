"""One pass per step: where π_old is π_θ at the update, the update pass's own log-probs (detached) are π_old, and the
loss, gradients, sampler correction, `sampling/*` metrics and guard equal the two-pass path's (a no-grad π_old pass,
then the fused loss). On the tiny Llama of `test_packed_training` (V = 97): every loss type, with the correction's
token and sequence modes, replay on and off, padded and packed, one and two micro-batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.kernels import backend
from grpo_kernels.options import LOSS_TYPES, LossOptions
from grpo_kernels.trainer.policy import OwnPass, PolicyModule, UpdateBatch
from grpo_kernels.trainer.sampler_correction import IS_MODES, SamplerCorrection
from grpo_kernels.trainer.sampler_sync import sampling_metrics
from grpo_kernels.trainer.sampling_replay import named_logprobs, old_policy_logprobs, pass_keywords
from grpo_kernels.trainer.update import inner_updates, micro_batch_rows
from tests.conftest import assert_close
from tests.test_packed_training import T, model, update_batch

EXTRA = {"dro": dict(dro_beta=0.1), "cispo": dict(epsilon_high=5.0)}  # what a loss type needs besides its name
REPLAY = dict(top_k=8, top_p=0.9)


def sampler_logp(batch: UpdateBatch, options: LossOptions, seed: int) -> torch.Tensor:
    """The sampler's log-probs: π_old's up to a small per-token error, so that the correction's ratio is not 1."""
    policy = PolicyModule(model("llama"))
    out = named_logprobs(
        policy.logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0, **pass_keywords(options))
    )
    noise = 0.02 * torch.randn(out["logp"].shape, generator=torch.Generator().manual_seed(seed))
    return (out["logp"] + noise).masked_fill(~batch.completion_mask, 0.0)  # [B, T]


def update(batch, options, correction, padding_free, one_pass, **split):
    """(inner_updates' metrics, π_old [B, T], the sampling metrics, each parameter's gradient) of one update, one
    or two passes."""
    policy = PolicyModule(model("llama"), padding_free)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    mask, sampled = batch.completion_mask, batch.sampling_logp
    kwargs = dict(options=options, num_iterations=1, max_grad_norm=1e9, **split)
    if one_pass:
        reported = {}
        stats = inner_updates(
            policy,
            optimizer,
            dataclasses.replace(batch, old_logp=None, is_ratio=None),
            own_pass=OwnPass(correction),
            before_first_step=reported.update,
            **kwargs,
        )
        logp, is_ratio, kept = reported["logp"], reported.get("is_ratio"), reported.get("log_kept_mass")
    else:
        rows = micro_batch_rows(batch, split.get("gradient_accumulation_steps", 1), None, policy)
        logp, _, kept = old_policy_logprobs(policy, batch, options, rows)  # the update's micro-batches
        is_ratio = correction.ratio(logp, sampled, mask)
        two_pass = dataclasses.replace(batch, old_logp=logp, is_ratio=is_ratio, sampling_logp=None)
        stats = inner_updates(policy, optimizer, two_pass, **kwargs)
    sampling = sampling_metrics(logp, sampled, mask, is_ratio, kept)
    return stats, logp, sampling, {n: p.grad for n, p in policy.named_parameters()}


CASES = (
    [(loss_type, False, False, 2) for loss_type in LOSS_TYPES]
    + [
        ("dapo", padding_free, replay, accumulation)
        for padding_free in (False, True)
        for replay in (False, True)
        for accumulation in (1, 2)
        if (padding_free, replay, accumulation) not in ((False, False, 2), (False, True, 1))
    ]
    + [("gspo_token", True, True, 2)]
)


@pytest.mark.parametrize("loss_type, padding_free, replay, accumulation", CASES)
def test_one_pass_equals_two_pass(loss_type, padding_free, replay, accumulation):
    index = LOSS_TYPES.index(loss_type)
    options = LossOptions(
        loss_type=loss_type,
        beta=0.04,
        max_completion_length=T,
        **EXTRA.get(loss_type, {}),
        **(REPLAY if replay else {}),
    )
    correction = SamplerCorrection(IS_MODES[index % len(IS_MODES)], 0.5, 1.5)  # each mode, some ratios clipped
    batch = update_batch(index)
    batch = dataclasses.replace(batch, sampling_logp=sampler_logp(batch, options, index))
    results = [
        update(batch, options, correction, padding_free, one_pass, gradient_accumulation_steps=accumulation)
        for one_pass in (False, True)
    ]
    (want_stats, want_logp, want_sampling, want_grads), (got_stats, got_logp, got_sampling, got_grads) = results
    assert got_stats == want_stats and got_sampling == want_sampling  # bitwise: the same floats
    assert torch.equal(got_logp, want_logp)
    if replay:
        assert "sampling/kept_mass" in got_sampling and "sampling/log_kept_mass" in got_stats
    assert max(g.abs().max() for g in want_grads.values()) > 0
    assert all(torch.equal(got_grads[name], grad) for name, grad in want_grads.items())


def test_the_reported_log_probs_are_the_first_updates():
    """At μ = 2 with bypass (a given old_logp, the sampler's), the guard's log-probs are those of the first update's
    passes, before its optimizer step: π_θ's initial log-probs, not those after the step."""
    batch = update_batch(3)
    options = LossOptions(loss_type="dapo", max_completion_length=T)
    policy = PolicyModule(model("llama"))
    before = named_logprobs(policy.logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0))
    calls = []
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    inner_updates(
        policy,
        optimizer,
        dataclasses.replace(batch, is_ratio=None),
        options=options,
        num_iterations=2,
        max_grad_norm=1e9,
        gradient_accumulation_steps=2,
        own_pass=OwnPass(),
        before_first_step=calls.append,
    )
    assert len(calls) == 1 and set(calls[0]) == {"logp"}
    assert_close(calls[0]["logp"], before["logp"], torch.float32, "the first pass's logp")


@pytest.mark.parametrize("mode", IS_MODES)
def test_fused_loss_forms_the_correction_from_its_own_log_probs(mode):
    """fused_linear_grpo_loss with old_logp None and a sampler correction equals the call given π_old and the ratio
    (a π_old pass's, same chunks) bitwise, on the 3-GEMM route: per token in each chunk, per sequence in the one
    chunk that holds every kept token, or after a no-grad pass over several chunks (`plan._needs_old_pass`)."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 7, 16, generator=g), 0.3 * torch.randn(50, 16, generator=g)
    targets, mask = torch.randint(0, 50, (3, 7), generator=g), torch.rand(3, 7, generator=g) > 0.2
    advantages, correction = torch.randn(3, generator=g), SamplerCorrection(mode, 0.9, 1.05)
    for chunk_size in (None, 4):
        common = dict(mask=mask, chunk_size=chunk_size, return_logprobs=True, backend="torch")
        old_logp = gk.fused_linear_token_logprobs(hidden, weight, targets, mask=mask, chunk_size=chunk_size)
        sampling_logp = (old_logp + 0.05 * torch.randn(3, 7, generator=g)).masked_fill(~mask, 0.0)
        results = []
        for own in (False, True):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            given = (
                dict(sampler_correction=correction, sampling_logp=sampling_logp)
                if own
                else dict(old_logp=old_logp, is_ratio=correction.ratio(old_logp, sampling_logp, mask))
            )
            before = backend.launches["fused_linear_token_loss"]
            out, logprobs = gk.fused_linear_grpo_loss(h, w, targets, advantages, **given, **common)
            out.loss.backward()
            fused = backend.launches["fused_linear_token_loss"] > before
            results.append((fused, out.loss, h.grad, w.grad, logprobs["logp"], out.metrics))
        (fused_two, *want), (fused_one, *got) = results
        assert fused_two and fused_one and torch.equal(got[3], old_logp)  # the returned log-probs: π_old's
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1:3], want[1:3], strict=True))
        assert got[4] == want[4]


def test_fused_loss_sampler_correction_arguments():
    hidden, weight, targets = torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long)
    correction, logp = SamplerCorrection("token_mask", None, 2.0), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sampler_correction needs sampling_logp"):
        gk.fused_linear_grpo_loss(hidden, weight, targets, torch.ones(2), sampler_correction=correction)
    with pytest.raises(ValueError, match="pass is_ratio=None"):
        gk.fused_linear_grpo_loss(
            hidden, weight, targets, torch.ones(2), sampler_correction=correction, sampling_logp=logp, is_ratio=logp
        )
    with pytest.raises(TypeError, match="sampler_correction must be a SamplerCorrection"):
        gk.fused_linear_grpo_loss(hidden, weight, targets, torch.ones(2), sampler_correction="token_mask")

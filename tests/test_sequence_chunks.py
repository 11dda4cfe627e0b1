"""A per-sequence sampler correction of the fused loss's own log-probs (old_logp None, TRL's `sequence_*` modes) over
kept rows that take several chunks: the chunks end at sequence boundaries and each forms its sequences' ratios from
its own log-probs (no no-grad π_old pass: two vocabulary passes per chunk, not three), with the loss, gradients and
metrics of the call given π_old and the ratio; a sequence longer than the chunk keeps the no-grad pass. And
`grpo_loss(sampler_correction=...)` on logits."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import grpo_kernels as gk
from grpo_kernels.engine import plan as plan_module
from grpo_kernels.engine import routes
from grpo_kernels.kernels import backend
from grpo_kernels.losses.sampler_ratio import SamplerCorrection
from tests.conftest import assert_close
from tests.test_host_syncs import HostReads

V, H = 50, 16


def test_sequence_chunks_hold_whole_sequences_within_the_budget():
    assert plan_module.sequence_chunks([2, 3, 6, 0, 4], 6) == (0, 5, 11, 15)
    assert plan_module.sequence_chunks([3, 3, 3], 6) == (0, 6, 9)
    assert plan_module.sequence_chunks([0, 0], 4) == (0,)
    assert plan_module.sequence_chunks([2, 7, 1], 6) is None  # a sequence longer than the budget


def batch(lengths: list[int], packed: bool, seed: int = 0):
    """(hidden, weight, targets, mask, advantages > 0, extra keywords) of sequences keeping `lengths` tokens each:
    padded [B, T] (each row's kept tokens among dropped ones) or packed [N] with cu_seqlens (one dropped token each)."""
    g = torch.Generator().manual_seed(seed)
    T, B = max(lengths) + 2, len(lengths)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, torch.randperm(T, generator=g)[:n]] = True
    extra = {}
    if packed:
        sizes = [n + 1 for n in lengths]
        mask = torch.cat([torch.arange(s) > 0 for s in sizes])  # [N]: each sequence's first token dropped
        extra["cu_seqlens"] = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    hidden = torch.randn(*mask.shape, H, generator=g)
    weight = 0.3 * torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, mask.shape, generator=g)
    return hidden, weight, targets, mask, 0.5 + torch.rand(B, generator=g), extra  # advantages: no sum near 0


def run(hidden, weight, targets, mask, advantages, extra, given, chunk_size):
    """(loss, dH, dW, metrics, returned logp, vocabulary passes launched, no-grad π_old passes) of one fused call."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    before = backend.launches["torch"]
    with mock.patch.object(routes, "vocab_pass", wraps=routes.vocab_pass) as old_pass:
        out, logprobs = gk.fused_linear_grpo_loss(
            h, w, targets, advantages, mask=mask, chunk_size=chunk_size, backend="torch", return_logprobs=True,
            loss_type="dapo", beta=0.0, **extra, **given,
        )  # fmt: skip
    out.loss.backward()
    passes = backend.launches["torch"] - before
    return out.loss, h.grad, w.grad, out.metrics, logprobs["logp"], passes, old_pass.call_count


def own_and_given(lengths, packed, mode, chunk_size, replay=None):
    """The call forming the correction from its own log-probs, and the call given π_old (a π_old pass's, uniform
    chunks of `chunk_size`) and the ratio; with sampling `replay`'s rule (`top_k`, `top_p`) in all three."""
    hidden, weight, targets, mask, advantages, extra = batch(lengths, packed)
    correction, replay = SamplerCorrection(mode, 0.9, 1.05), replay or {}
    old = gk.fused_linear_token_logprobs(hidden, weight, targets, mask=mask, chunk_size=chunk_size, **replay)
    sampled = (old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))).masked_fill(~mask, 0)
    cu = extra.get("cu_seqlens")
    padded_ratio = correction.ratio(*(padded(x, cu) for x in (old, sampled, mask)))
    call = (hidden, weight, targets, mask, advantages, extra | replay)
    own = run(*call, dict(sampler_correction=correction, sampling_logp=sampled), chunk_size)
    given = run(*call, dict(old_logp=old, is_ratio=padded_ratio), chunk_size)
    return own, given, old


def padded(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """A packed [N] tensor as [S, T_max] (0 / False after each sequence's end); padded ones as they are."""
    if cu_seqlens is None:
        return x
    return torch.nn.utils.rnn.pad_sequence(list(x.split(cu_seqlens.diff().tolist())), batch_first=True)


@pytest.mark.parametrize(
    "packed, replay",
    [(False, None), (False, dict(top_k=8, top_p=0.9))],
    ids=["padded", "replay"],
)
@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_sequence_modes_over_several_chunks_take_no_old_pass(mode, packed, replay):
    lengths, chunk_size = [2, 3, 6, 0, 4, 1], 6  # chunks of whole sequences: 2 + 3 | 6 | 4 + 1
    own, given, old = own_and_given(lengths, packed, mode, chunk_size, replay)
    assert own[5:] == (2 * 3, 0)  # three chunks, each a forward and its gradient pass; no π_old pass
    for got, want, name in zip(own[:3], given[:3], ("loss", "dH", "dW"), strict=True):
        assert_close(got, want, torch.float32, name)
    assert own[1].abs().max() > 0
    assert own[3].keys() == given[3].keys()
    for name, value in given[3].items():
        assert_close(own[3][name], value, torch.float32, name)
    assert_close(own[4], old, torch.float32, "logp")


def test_sequence_chunks_equal_to_uniform_ones_give_the_two_pass_results_bitwise():
    """Sequences of 3 kept tokens in chunks of 6 rows: the chunks of whole sequences are the uniform ones, so the
    one pass is the two-pass call's floats."""
    own, given, old = own_and_given([3, 3, 3, 3, 3], False, "sequence_mask", 6)
    assert own[5:] == (2 * 3, 0) and torch.equal(own[4], old)
    assert all(torch.equal(a, b) for a, b in zip(own[:3], given[:3], strict=True)) and own[3] == given[3]


def test_packed_rows_keep_the_no_grad_pass_and_the_two_pass_floats():
    """Packed rows (the trainer's padding-free micro-batches) over several chunks: the no-grad pass gives π_old first
    and the chunks stay uniform, so the results are the two-pass call's bitwise."""
    own, given, old = own_and_given([2, 3, 6, 0, 4, 1], True, "sequence_mask", 6)
    assert own[5:] == (3 * 3, 1) and given[5:] == (2 * 3, 0)  # 16 kept rows: three chunks of at most 6
    assert all(torch.equal(a, b) for a, b in zip(own[:3], given[:3], strict=True)) and own[3] == given[3]
    assert torch.equal(own[4], old)


def test_a_sequence_longer_than_the_chunk_keeps_the_no_grad_pass():
    """One sequence of 7 kept tokens, chunks of 4 rows: the no-grad pass gives π_old first (one more pass per
    chunk), the chunks stay 4 rows, and the results are the two-pass call's bitwise."""
    own, given, old = own_and_given([2, 7, 3], False, "sequence_truncate", 4)
    assert own[5:] == (3 * 3, 1) and given[5:] == (2 * 3, 0)  # 12 kept rows: three chunks of 4
    assert all(torch.equal(a, b) for a, b in zip(own[:3], given[:3], strict=True)) and own[3] == given[3]
    assert torch.equal(own[4], old)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_grpo_loss_forms_the_sampler_correction(mode):
    """On logits: given π_old, the ratio is the hand formula's (the call given is_ratio, bitwise); with old_logp None
    π_old is the pass's own log-probs (the fused lm_head's call, within float32)."""
    hidden, weight, targets, mask, advantages, _ = batch([2, 3, 4], False)
    correction = SamplerCorrection(mode, 0.9, 1.05)
    old = gk.token_logprobs(hidden @ weight.T, targets, mask=mask)
    sampled = (old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))).masked_fill(~mask, 0)
    ratio = ((old - sampled) * mask).sum(1).exp() if mode.startswith("sequence") else (old - sampled).exp()
    ratio = ratio.clamp(0.9, 1.05) if mode.endswith("truncate") else ratio * ((ratio >= 0.9) & (ratio <= 1.05))
    common = dict(mask=mask, loss_type="dapo", beta=0.0, backend="torch")

    def loss(source, **given):
        x = source.clone().requires_grad_()
        out = gk.grpo_loss(x, targets, advantages, **given, **common)
        out.loss.backward()
        return out.loss, x.grad, out.metrics

    logits = hidden @ weight.T
    hand, formed = (
        loss(logits, old_logp=old, is_ratio=ratio),
        loss(logits, old_logp=old, sampler_correction=correction, sampling_logp=sampled),
    )
    assert torch.equal(hand[0], formed[0]) and torch.equal(hand[1], formed[1])
    own = loss(logits, sampler_correction=correction, sampling_logp=sampled)
    fused = gk.fused_linear_grpo_loss(
        hidden, weight, targets, advantages, sampler_correction=correction, sampling_logp=sampled, **common
    )
    assert_close(own[0], hand[0], torch.float32, "loss")
    assert_close(own[1], hand[1], torch.float32, "dlogits")
    assert_close(fused.loss, own[0], torch.float32, "fused loss")
    for name, value in fused.metrics.items():
        assert_close(own[2][name], value, torch.float32, name)


def test_sampler_correction_arguments_on_logits():
    logits, targets, logp = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    correction = SamplerCorrection("sequence_mask", None, 2.0)
    with pytest.raises(ValueError, match="sampler_correction needs sampling_logp"):
        gk.grpo_loss(logits, targets, torch.ones(2), sampler_correction=correction)
    with pytest.raises(ValueError, match="pass is_ratio=None"):
        gk.grpo_loss(logits, targets, torch.ones(2), sampler_correction=correction, sampling_logp=logp, is_ratio=logp)
    with pytest.raises(TypeError, match="sampler_correction must be a SamplerCorrection"):
        gk.grpo_loss(logits, targets, torch.ones(2), sampler_correction="token_mask")
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # refused before any collective
    with pytest.raises(ValueError, match="'sequence_mask' does not run with sequence_group"):
        gk.grpo_loss(
            logits.flatten(0, 1), targets.flatten(), torch.ones(2), sampler_correction=correction,
            sampling_logp=logp.flatten(), cu_seqlens=torch.tensor([0, 3, 6]), sequence_group=group,
        )  # fmt: skip


def test_sequence_chunks_add_no_host_sync():
    """Each sequence's kept-row count joins the kept-row count's read (`test_host_syncs`): with the checks off, that
    one read before the first kernel is the engine's only one (the torch backend's CPU kernels read on their own)."""
    hidden, weight, targets, mask, advantages, _ = batch([2, 3, 6, 0, 4, 1], False)
    sampled = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    with HostReads() as host:
        out = gk.fused_linear_grpo_loss(
            hidden, weight.requires_grad_(), targets, advantages, mask=mask, chunk_size=6, backend="torch",
            check_finite=False, sampler_correction=SamplerCorrection("sequence_mask", None, 3.0),
            sampling_logp=sampled,
        )  # fmt: skip
        out.loss.backward()
    engine = [read for read in host.reads if not read[1].startswith("kernels/torch/")]
    assert len(engine) == 1, host.reads

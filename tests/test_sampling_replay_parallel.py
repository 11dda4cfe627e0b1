"""Sampling replay on vocabulary shards (2 gloo ranks, CPU) against one process on the whole vocabulary (itself held
to the float64 oracle by test_sampling_replay*.py): the rule's thresholds merged over the shards (min-p from the
merged max, top-k from the shards' candidates, top-p on the merged candidates), kept ids split by shard, the log
kept mass and outside flags merged, every gradient; and the bound on top_p there."""

import traceback

import pytest
import torch
import torch.distributed as dist

import grpo_kernels as gk
from tests.conftest import assert_close
from tests.rendezvous import join, spawn_ranks
from tests.replay_cases import RULES, STATS, padded, support_of

F32 = torch.float32
V, H, B, T = 37, 8, 3, 5
SHARDS = [20, 17]


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0, 0] = True
    return dict(
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(V, H, generator=g) / H**0.5 * 3,
        bias=torch.randn(V, generator=g),
        targets=torch.randint(0, V, (B, T), generator=g),
        mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logp=torch.randn(B, T, generator=g) * 0.2 - 2.0,
    )


def _cols(rank: int) -> slice:
    start = sum(SHARDS[:rank])
    return slice(start, start + SHARDS[rank])


def _grads(outs, leaves, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    objective = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    return torch.autograd.grad(objective, leaves)


def _check_logits(rank: int, backend: str) -> None:
    x, cols = _inputs(), _cols(rank)
    logits = x["hidden"] @ x["weight"].T  # [B, T, V]
    logits[0, 1, 3] = logits[0, 1, 30] = logits[0, 1].topk(8).values[-1]  # ties across the shards at the 8th
    kw = dict(with_entropy=True, stats=STATS, temperature=0.7, mask=x["mask"], backend=backend, inplace=False)
    support = support_of(logits, RULES["all"], temperature=0.7)
    for name, replay in (
        ("rule", RULES["all"]),
        ("top_k ties", {"top_k": 8, "top_p": 0.95, "final_logit_softcapping": 3.0}),  # 10 kept at [0, 1]
        ("min_p", {"min_p": 0.1}),
        ("kept ids", {"sampling_mask": padded(support)}),
    ):
        whole = logits.clone().requires_grad_()
        want = gk.token_logprobs(whole, x["targets"], **kw, **replay)
        (d_want,) = _grads((want["logp"], want["entropy"]), [whole])
        part = logits[..., cols].clone().requires_grad_()
        got = gk.token_logprobs(part, x["targets"], process_group=dist.group.WORLD, **kw, **replay)
        (d_got,) = _grads((got["logp"], got["entropy"]), [part])
        for stat in ("logp", "entropy", "log_kept_mass"):
            assert_close(got[stat], want[stat], F32, f"{backend} {name} {stat}")
        assert torch.equal(got["outside_support"], want["outside_support"]), f"{backend} {name} outside"
        assert_close(d_got, d_want[..., cols], F32, f"{backend} {name} dlogits")
        assert want["outside_support"].any() and (want["log_kept_mass"][x["mask"]] < 0).all()


def _check_fused_and_loss(rank: int) -> None:
    x, cols = _inputs(seed=3), _cols(rank)
    kw = dict(with_entropy=True, stats=STATS, temperature=0.8, mask=x["mask"], backend="torch", chunk_size=4)
    leaves = [x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()]
    leaves.append(x["bias"].clone().requires_grad_())
    want = gk.fused_linear_token_logprobs(leaves[0], leaves[1], x["targets"], bias=leaves[2], **kw, **RULES["all"])
    d_want = _grads((want["logp"], want["entropy"]), leaves)
    ours = [x["hidden"].clone().requires_grad_(), x["weight"][cols].clone().requires_grad_()]
    ours.append(x["bias"][cols].clone().requires_grad_())
    got = gk.fused_linear_token_logprobs(
        ours[0], ours[1], x["targets"], bias=ours[2], process_group=dist.group.WORLD, **kw, **RULES["all"]
    )
    d_got = _grads((got["logp"], got["entropy"]), ours)
    for stat in ("logp", "entropy", "log_kept_mass"):
        assert_close(got[stat], want[stat], F32, f"fused {stat}")
    assert torch.equal(got["outside_support"], want["outside_support"])
    for name, a, b in (
        ("dH", d_got[0], d_want[0]),
        ("dW", d_got[1], d_want[1][cols]),
        ("db", d_got[2], d_want[2][cols]),
    ):
        assert_close(a, b, F32, f"fused {name}")

    logits = x["hidden"] @ x["weight"].T
    side = {k: x[k] for k in ("advantages", "old_logp", "mask")}
    options = dict(temperature=0.8, backend="torch", inplace=False, replay_entropy="full", entropy_coef=0.1)
    whole = logits.clone().requires_grad_()
    want = gk.grpo_loss(whole, x["targets"], **side, **options, **RULES["all"])
    want.loss.backward()
    part = logits[..., cols].clone().requires_grad_()
    got = gk.grpo_loss(part, x["targets"], **side, process_group=dist.group.WORLD, **options, **RULES["all"])
    got.loss.backward()
    assert_close(got.loss, want.loss, F32, "loss")
    assert_close(part.grad, whole.grad[..., cols], F32, "loss dlogits")
    for name in ("sampling/log_kept_mass", "sampling/outside_support", "entropy"):
        assert_close(got.metrics[name], want.metrics[name], F32, name)


def _worker(rank: int, store: str, queue) -> None:
    join(rank, 2, store)
    try:
        _check_logits(rank, "torch")
        _check_logits(rank, "triton")
        _check_fused_and_loss(rank)
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001  reported to the test, which fails with it
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_two_shards_equal_one_process():
    spawn_ranks(_worker, 2)


def test_top_p_on_shards_needs_top_k():
    from grpo_kernels.engine.validate import SHARD_TOP_K, check_shard_rule

    check_shard_rule(SHARD_TOP_K, 0.9, 151_936)
    for top_k in (0, SHARD_TOP_K + 1, V):
        with pytest.raises(ValueError, match=r"top_p=0.9 on vocabulary shards \(process_group\) needs top_k"):
            check_shard_rule(top_k, 0.9, V)

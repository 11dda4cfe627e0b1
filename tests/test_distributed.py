"""Global normalisers: 2 ranks × half a batch (gloo, CPU) make the same update as 1 rank × the whole batch."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_kernels as gk
from grpo_kernels import distributed
from tests.conftest import assert_close
from tests.rendezvous import join, rendezvous

B, T, V, H = 4, 6, 23, 8
OPTIONS = [
    dict(loss_type="dapo", epsilon_high=0.28, beta=0.04),
    dict(loss_type="grpo", loss_agg_mode="seq-mean-token-mean", beta=0.04),
]


def _batch():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, :] = True
    mask[3, :] = False  # rank 1's second sequence is fully masked: unequal token counts per rank
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 3.0
    return hidden, weight, targets, mask, adv, old


def _weight_grad(rows: slice, options: dict, normalisers: dict) -> torch.Tensor:
    """dL/dW of an lm_head W through grpo_loss on the rows of the batch this rank holds."""
    hidden, weight, targets, mask, adv, old = _batch()
    weight.requires_grad_()
    logits = hidden[rows] @ weight.T  # [b, T, V]
    out = gk.grpo_loss(
        logits, targets[rows], adv[rows], old[rows], old[rows] + 0.05, mask[rows], **options, **normalisers
    )
    out.loss.backward()
    return weight.grad


def _normalisers(mask: torch.Tensor) -> dict:
    return {
        "num_items_in_batch": distributed.num_items_in_batch(mask),
        "num_sequences_in_batch": distributed.num_sequences_in_batch(mask),
    }


def _rank(rank: int, store: str, queue) -> None:
    """Every option's averaged dL/dW on 2 ranks, in one launch (starting the processes is the slow part)."""
    join(rank, 2, store)
    rows = slice(2 * rank, 2 * rank + 2)
    for index, options in enumerate(OPTIONS):
        grad = _weight_grad(rows, options, _normalisers(_batch()[3][rows]))
        dist.all_reduce(grad)  # what DDP does: the average over ranks
        if rank == 0:  # by value: a tensor's shared memory would vanish with this process, before the test reads it
            queue.put((index, (grad / 2).numpy()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def averaged_on_two_ranks() -> dict[int, torch.Tensor]:
    """OPTIONS index -> the 2 ranks' averaged dL/dW, from one launch of 2 processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with rendezvous() as store:
        procs = [ctx.Process(target=_rank, args=(r, store, queue)) for r in range(2)]
        for p in procs:
            p.start()
        averaged = {index: torch.from_numpy(grad) for index, grad in (queue.get(timeout=120) for _ in OPTIONS)}
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    return averaged


@pytest.mark.parametrize("index", range(len(OPTIONS)), ids=[o.get("loss_agg_mode", o["loss_type"]) for o in OPTIONS])
def test_two_ranks_equal_one(index, averaged_on_two_ranks):
    full = _weight_grad(slice(0, B), OPTIONS[index], _normalisers(_batch()[3]))
    assert_close(averaged_on_two_ranks[index], full, torch.float32, "dL/dW")


def test_local_normalisers_would_differ():
    """The check above can fail: with each rank's own token count the averaged update is not the full batch's."""
    options = OPTIONS[0]
    full = _weight_grad(slice(0, B), options, {})
    halves = [_weight_grad(slice(r, r + 2), options, {}) for r in (0, 2)]
    assert not torch.allclose((halves[0] + halves[1]) / 2, full, rtol=1e-3)


def test_without_process_group_counts_locally():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert distributed.num_items_in_batch([mask, mask]).item() == 4.0
    assert distributed.num_sequences_in_batch(mask).item() == 1.0

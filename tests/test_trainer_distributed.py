"""The trainer's data parallelism on CPU (gloo): 2 processes × half the batch × 2 accumulation micro-batches (or,
padding-free, uneven micro-batches filled by a token budget) make the same update as 1 process on the whole batch,
under DDP and under FSDP2, for every kind of normaliser, also where the update pass is its own π_old pass
(`policy.own_pass_loss`); and `torchrun -m grpo_kernels.train` runs, logs once and checkpoints."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.logging import read_metrics
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.parallel import ParallelState, wrap_policy
from grpo_kernels.trainer.policy import OwnPass, PolicyModule, UpdateBatch
from grpo_kernels.trainer.update import inner_updates
from tests.rendezvous import join, rendezvous

REPO = Path(__file__).resolve().parents[1]
B, P, T = 8, 3, 5
LOSSES = {  # one per normaliser kind of grpo_kernels.distributed.micro_batch_scale
    "grpo": dict(loss_type="grpo", beta=0.04),  # per-row (sequence mean)
    "bnpo": dict(loss_type="bnpo"),  # the batch's token mean
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),  # num_items_in_batch
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=T),  # per-row constant
    "token_sum": dict(loss_type="dapo", loss_agg_mode="token-sum"),  # batch-independent
    "seq_mean": dict(loss_type="grpo", loss_agg_mode="seq-mean-token-mean"),  # num_sequences_in_batch
}
MODES = ("ddp", "fsdp")
ONE_PASS = ("grpo", "dapo")  # per-row and num_items_in_batch normalisers, with the update pass as π_old's


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_tiny_llama(build_tokenizer("0123456789+="), 16, 2, 2, P + T)


def _batch() -> UpdateBatch:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 16, (B, P + T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    mask[5] = False  # a fully masked completion: unequal token counts per rank and per micro-batch
    mask[6, 1:] = False
    old = torch.randn(B, T, generator=g) * 0.1 - 2.8
    return UpdateBatch(
        input_ids=input_ids,
        attention_mask=torch.ones(B, P + T, dtype=torch.long),
        completion_mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logp=old.masked_fill(~mask, 0.0),
        ref_logp=(old + 0.05).masked_fill(~mask, 0.0),
    )


def _with_pi_old(batch: UpdateBatch) -> UpdateBatch:
    """`batch` with old_logp from a no-grad pass of the initial model: the two-pass path's π_old."""
    with torch.no_grad():
        logp, _ = PolicyModule(_model()).logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    return dataclasses.replace(batch, old_logp=logp)


def _update(
    batch: UpdateBatch,
    state: ParallelState,
    loss: dict,
    accumulation: int,
    max_tokens: int | None = None,
    one_pass: bool = False,
) -> tuple[float, list]:
    """One SGD step (lr 1, no clipping) on `batch`: (the step's loss, the full parameters after it). With
    `max_tokens`: padding-free, micro-batches filled up to that many tokens; with `one_pass`, π_old is the update
    pass's own."""
    if one_pass:
        batch = dataclasses.replace(batch, old_logp=None)
    policy = wrap_policy(PolicyModule(_model(), padding_free=max_tokens is not None), state)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    stats = inner_updates(
        policy,
        optimizer,
        batch,
        options=LossOptions(**loss),
        num_iterations=1,
        max_grad_norm=1e9,
        gradient_accumulation_steps=accumulation,
        max_tokens_per_microbatch=max_tokens,
        own_pass=OwnPass() if one_pass else None,
    )
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in policy.parameters()]
    return stats["loss"], [p.clone() for p in params]


def _rank(rank: int, store: str, results) -> None:
    """Every mode and loss on 2 ranks, in one launch (starting the processes is the slow part)."""
    torch.set_num_threads(1)
    join(rank, 2, store)
    rows = slice(rank * B // 2, (rank + 1) * B // 2)
    half = UpdateBatch(**{k: None if v is None else v[rows] for k, v in vars(_batch()).items()})
    for mode in MODES:
        state = ParallelState(rank, 2, torch.device("cpu"), mode)
        for name, loss in LOSSES.items():
            value, params = _update(half, state, loss, accumulation=2)
            total = torch.tensor(value, dtype=torch.float64)
            dist.all_reduce(total)
            if rank == 0:
                results[mode, name] = (total.item() / 2, params)
            value, params = _update(half, state, loss, accumulation=1, max_tokens=3 * (P + T))  # 4 rows: 3 + 1
            total = torch.tensor(value, dtype=torch.float64)
            dist.all_reduce(total)
            if rank == 0:
                results[mode, name, "tokens"] = (total.item() / 2, params)
        for name in ONE_PASS:
            value, params = _update(half, state, LOSSES[name], accumulation=2, one_pass=True)
            total = torch.tensor(value, dtype=torch.float64)
            dist.all_reduce(total)
            if rank == 0:
                results[mode, name, "one_pass"] = (total.item() / 2, params)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_updates() -> dict:
    """(mode, loss[, "tokens"]) -> (the step's loss, the parameters after it), from one launch of 2 processes."""
    with mp.Manager() as manager, rendezvous() as store:
        results = manager.dict()
        mp.spawn(_rank, args=(store, results), nprocs=2, join=True)
        return dict(results)


@pytest.fixture(scope="module")
def one_process_updates() -> dict:
    """loss -> (the step's loss, the parameters after it) of 1 process on the whole batch."""
    single = ParallelState(0, 1, torch.device("cpu"), "none")
    updates = {name: _update(_batch(), single, loss, accumulation=1) for name, loss in LOSSES.items()}
    two_pass = {(name, "two_pass"): _update(_with_pi_old(_batch()), single, LOSSES[name], 1) for name in ONE_PASS}
    return {**updates, **two_pass}


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_with_accumulation_equal_one_process(mode, two_rank_updates, one_process_updates):
    results = two_rank_updates
    initial = [p.detach() for p in _model().parameters()]
    for name in LOSSES:
        want_loss, want = one_process_updates[name]
        moved = max((w - p0).abs().max().item() for w, p0 in zip(want, initial, strict=True))
        assert moved > 1e-4, f"{name}: the step did not move the parameters, the comparison would be empty"
        for key in ((mode, name), (mode, name, "tokens")):  # row micro-batches; padding-free token-budget ones
            got_loss, got = results[key]
            assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7), key
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_one_pass_equal_one_process_two_pass(mode, two_rank_updates, one_process_updates):
    for name in ONE_PASS:
        want_loss, want = one_process_updates[name, "two_pass"]
        got_loss, got = two_rank_updates[mode, name, "one_pass"]
        assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7), name
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_torchrun_trains_logs_and_checkpoints(tmp_path, mode):
    """`torchrun --nproc_per_node=2 -m grpo_kernels.train` on the demo: one metrics log (rank 0), checkpoints
    that load into a plain model."""
    out = tmp_path / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # a port of its own
    cmd += ["-m", "grpo_kernels.train", "--output-dir", str(out), "--steps", "3", "--parallel", mode]
    cmd += ["--prompts-per-step", "4", "--num-generations", "4", "--gradient-accumulation-steps", "2"]
    cmd += ["--eval-every", "0", "--checkpoint-every", "2", "--no-progress", "--no-plot"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and "eval/answer" in records[-1] for r in records)  # finite, evaluated
    step2 = out / "checkpoints" / "step_000002"
    assert {"model.safetensors", "trainer_state.pt", "rng_rank0.pt", "rng_rank1.pt"} <= {
        p.name for p in step2.iterdir()
    }

"""The ranks of test_trainer_presets' `gather_inputs` test, in a module of their own: each spawned process imports
the module of its target, and this one imports only what the ranks run (not the trainer, not transformers)."""

import torch
import torch.distributed as dist

from grpo_kernels.trainer.components import gather_inputs, local_part
from grpo_kernels.trainer.parallel import ParallelState
from tests.rendezvous import join


def gather_rank(rank: int, store: str, results) -> None:
    """Rank `rank` of 2: per-token inputs of a different length on each rank, gathered and split back."""
    join(rank, 2, store)
    state = ParallelState(rank, 2, torch.device("cpu"), "ddp")
    length = 2 + rank  # the ranks' completions differ in length
    inputs = {
        "rewards": torch.tensor([1.0, 2.0]) + 10 * rank,
        "group_ids": torch.tensor([0, 0]),
        "mask": torch.ones(2, length, dtype=torch.bool),
        "entropy": torch.full((2, length), float(rank)),
    }
    gathered = gather_inputs(inputs, state)
    if rank == 0:
        results.update({k: v.clone() for k, v in gathered.items()})
    results[f"local{rank}"] = local_part(gathered["entropy"] + 1, 2, length, state).clone()
    dist.destroy_process_group()

"""Ranks agree on the fused lm_head's route: two gloo processes run the TRL drop-in, one of them with almost no
free memory (where `memory="auto"` alone picks "lean" and the other rank "fast"); both must take the same route,
finish, and give what stock TRL's loss gives for their rows. Under ZeRO-3, two routes mean two sets of collectives
(lean gathers the weight again in its backward), and a rank waiting in a gather the other never makes hangs."""

import pytest
import torch

pytest.importorskip("trl")

from tests.test_trl import assert_same, build, make_inputs, model_path, tokenizer  # noqa: E402, F401  (fixtures)


def _worker(rank: int, world: int, store: str, root: str) -> None:
    import os

    import trl

    import grpo_kernels.engine.memory as memory
    from grpo_kernels.integrations import trl as drop_in
    from grpo_kernels.trainer.model import build_tokenizer
    from tests.rendezvous import join

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    join(rank, world, store)
    if rank == 1:
        memory.available_bytes = lambda device: 1  # almost no free memory on this rank
    routes = []
    resolve = memory.resolve_memory
    memory.resolve_memory = lambda *args, **kwargs: routes.append(resolve(*args, **kwargs)) or routes[-1]
    characters = build_tokenizer("abcdefghij")
    stock = build(trl.GRPOTrainer, root, characters, loss_type="dapo")
    ours = build(drop_in.GRPOTrainer, root, characters, loss_type="dapo")
    inputs = make_inputs(stock, seed=rank)
    items = inputs["completion_mask"].sum()
    torch.distributed.all_reduce(items)
    inputs["num_items_in_batch"] = items
    routes.clear()
    assert_same(stock, ours, inputs)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, routes)
    assert everyone[0] == everyone[1] == ["lean"], everyone


def test_a_rank_short_of_memory_takes_every_rank_to_the_same_route(model_path, tmp_path):  # noqa: F811
    import torch.multiprocessing as mp

    from tests.rendezvous import rendezvous

    with rendezvous() as store:
        mp.spawn(_worker, args=(2, store, model_path()), nprocs=2, join=True)

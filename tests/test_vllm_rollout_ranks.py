"""VLLMRollout under 2 processes (gloo, as torchrun would start them; the stand-in `vllm` of `tests/fake_vllm.py`):
each rank's engine is built through `build_vllm_rollout` from the trainer's config and lands on its own GPU
(cuda:LOCAL_RANK, with "external_launcher" and the rank's RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR), with its own
seed, leaves that rank's random state (seeded per rank by the trainer) as it was, and the ranks sample different
completions of the same prompts."""

import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_kernels.trainer import vllm_engine
from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.tasks import build_task
from grpo_kernels.trainer.vllm_rollout import build_vllm_rollout
from tests import fake_vllm
from tests.rendezvous import join, rendezvous

ALPHABET = "0123456789+="
TORCHRUN_PORT = "29500"  # what torchrun would set: the engine must pass it on (the ranks meet at a file store)
CONFIG = dict(rollout="vllm", model="tiny-dir", prompts_per_step=4, num_generations=4, max_completion_length=4, seed=3)


def _rank(rank: int, store: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=TORCHRUN_PORT, WORLD_SIZE="2", RANK=str(rank))
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    torch.set_num_threads(1)
    join(rank, 2, store)
    tokenizer = build_tokenizer(ALPHABET)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_tiny_llama(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_length=16)
    probs = torch.ones(len(tokenizer))  # [V]
    probs[[0, 1, 3]] = 0.0
    fake_vllm.install(None, official=True, eos_token_ids=(tokenizer.eos_token_id,), probs=probs / probs.sum())
    vllm_engine.gpu_memory = lambda device: (60 * 2**30, 80 * 2**30)  # this process's: no GPU here
    config = TrainConfig(**CONFIG)
    parallel = ParallelState(rank, 2, torch.device(f"cuda:{rank}"), "ddp")
    torch.manual_seed(config.seed + rank), random.seed(config.seed + rank), np.random.seed(config.seed + rank)
    torch.rand(3), random.random(), np.random.rand()  # a trainer some way into its streams (vLLM reseeds afresh)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    rollout = build_vllm_rollout(config, model, tokenizer, parallel, build_task(config))
    kept = (
        random.getstate() == before[0]
        and bool((np.random.get_state()[1] == before[1]).all())
        and torch.equal(torch.get_rng_state(), before[2])
    )
    batch = rollout.generate(["1+2=", "3+4="], config.num_generations)
    llm = rollout.llm
    results[rank] = dict(
        env=llm.env, kwargs=llm.kwargs, device=llm.device_index, rng_kept=kept, ids=batch.completion_ids
    )
    dist.destroy_process_group()


def test_each_rank_builds_its_own_engine_on_its_own_gpu():
    with mp.Manager() as manager, rendezvous() as store:
        results = manager.dict()
        mp.spawn(_rank, args=(store, results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        got = results[rank]
        assert got["device"] == rank, "the engine must run on cuda:LOCAL_RANK, not cuda:0"
        assert got["env"]["RANK"] == str(rank) and got["env"]["LOCAL_RANK"] == str(rank)
        assert got["env"]["WORLD_SIZE"] == "2" and got["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert got["env"]["MASTER_PORT"] == TORCHRUN_PORT and got["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert got["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert got["kwargs"]["seed"] == CONFIG["seed"] + rank
        assert got["kwargs"]["max_num_seqs"] == CONFIG["prompts_per_step"] // 2 * CONFIG["num_generations"]
        assert got["rng_kept"], f"rank {rank}: building the engine changed the trainer's random state"
    assert not torch.equal(results[0]["ids"], results[1]["ids"]), "both ranks sampled the same completions"

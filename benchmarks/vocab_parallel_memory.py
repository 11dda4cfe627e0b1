"""Extra peak RSS of the fused lm_head + loss on a vocabulary shard against the whole weight (CPU, Linux).

    python -m benchmarks.vocab_parallel_memory            # 1 process on [V, H], then 2 gloo ranks on [V/2, H] each

Each run is one forward + backward of `fused_linear_grpo_loss` (dapo) in a fresh process; the extra peak is VmHWM
after the step minus VmRSS before it (as `measure_cpu_memory`). Per rank the pass holds one [rows, V_r] chunk and
dW [V_r, H], so a shard of V/2 should need about half the unsharded extra memory; the inputs (weight, hidden) are
allocated before the measurement starts and are not counted.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.peak_memory import reset_peak_rss, status_kib

SHAPE = dict(B=4, T=256, V=151936, H=896)  # Qwen2.5-0.5B's lm_head


def _inputs(B: int, T: int, V: int, H: int):
    torch.manual_seed(0)
    hidden = torch.randn(B, T, H).requires_grad_()
    weight = torch.randn(V, H) / H**0.5
    targets = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) < 0.78
    return hidden, weight, targets, mask, torch.randn(B), torch.randn(B, T) - 12


def run(world: int, rank: int, port: int) -> None:
    import grpo_kernels as gk

    hidden, weight, targets, mask, adv, old = _inputs(**SHAPE)
    group = {}
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        rows = weight.shape[0] // world
        weight = weight[rank * rows : (rank + 1) * rows].clone()
        group = dict(process_group=dist.group.WORLD)
    weight.requires_grad_()
    base = reset_peak_rss()
    start = time.perf_counter()
    loss = gk.fused_linear_grpo_loss(hidden, weight, targets, adv, old, mask=mask, loss_type="dapo", **group).loss
    loss.backward()
    seconds = time.perf_counter() - start
    extra = (status_kib("VmHWM") - base) / 2**20
    grad_w = weight.numel() * 4 / 2**30
    print(
        f"world {world} rank {rank}: weight {list(weight.shape)}, {seconds:.2f} s, extra peak RSS {extra:.3f} GiB "
        f"(grad_W {grad_w:.3f} GiB)",
        flush=True,
    )
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(*map(int, sys.argv[1:]))
    else:
        me = [sys.executable, "-m", "benchmarks.vocab_parallel_memory"]
        subprocess.run([*me, "1", "0", "0"], check=True)
        port = str(_free_port())
        ranks = [subprocess.Popen([*me, "2", str(r), port]) for r in range(2)]
        assert all(p.wait() == 0 for p in ranks)

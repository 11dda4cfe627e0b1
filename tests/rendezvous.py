"""Where the tests' spawned gloo ranks meet: a file store in a folder of their own, never a TCP port. A port found
free and released again can be taken by another test's socket before rank 0 binds it (the suite runs on several
workers at once), and a gloo rank that meets a stranger's socket aborts its process."""

import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


@contextmanager
def rendezvous() -> Iterator[str]:
    """The path of a file store in a fresh folder, removed when the ranks are done: what `join` takes."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        yield str(Path(folder) / "store")


def join(rank: int, world: int, store: str) -> None:
    """Join the `world` gloo ranks that meet at `store`."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def run_rank(rank: int, world: int, store: str, queue, checks: Callable[[], None]) -> None:
    """Join the ranks, run `checks` and report to `queue` as `spawn_ranks` reads it: (rank, None), or (rank, the
    traceback of what failed); the process group is destroyed either way."""
    join(rank, world, store)
    try:
        checks()
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001  reported to the test, which fails with it
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, world: int, *args, timeout: float = 600) -> None:
    """Run `worker(rank, store, queue, *args)` on `world` spawned gloo ranks; each puts (rank, None) on the queue,
    or (rank, its traceback), and a failure on any rank fails the caller with every rank's report."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with rendezvous() as store:
        procs = [ctx.Process(target=worker, args=(r, store, queue, *args)) for r in range(world)]
        for p in procs:
            p.start()
        reports = [queue.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failures = [f"rank {rank}:\n{error}" for rank, error in sorted(reports) if error is not None]
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs)

"""Where the tests' spawned gloo ranks meet: a file store in a folder of their own, never a TCP port. A port found
free and released again can be taken by another test's socket before rank 0 binds it (the suite runs on several
workers at once), and a gloo rank that meets a stranger's socket aborts its process."""

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist


@contextmanager
def rendezvous() -> Iterator[str]:
    """The path of a file store in a fresh folder, removed when the ranks are done: what `join` takes."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        yield str(Path(folder) / "store")


def join(rank: int, world: int, store: str) -> None:
    """Join the `world` gloo ranks that meet at `store`."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

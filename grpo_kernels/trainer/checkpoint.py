"""Checkpoints: everything `--resume` needs to continue exactly as if the run had never stopped.

`<output_dir>/checkpoints/step_000050/` holds the policy as a Hugging Face directory (`model.safetensors`,
`config.json`, the tokenizer; with `--lora`, peft's adapter directory), the reference model
(`ref_model.safetensors`, when there is one), `trainer_state.pt` (step, the whole optimizer state, the prompt
stream's position, the run's config) and `rng_rank<r>.pt` for each data-parallel rank (torch CPU and CUDA, Python).
`step_000000` is the initial policy.

A checkpoint is written to `step_XXXXXX.tmp/` with `checksums.json` (the SHA-256 of every other file), every file
fsynced, then renamed, so a run killed (or a machine that loses power) while saving leaves the previous checkpoint
as the latest. A failed write removes its `.tmp/` folder and says what failed (`DiskFull`, `CheckpointWriteError`).
Reading never runs code: the `.pt` files load with `torch.load(weights_only=True)` (tensors and plain data only),
and `read` checks every file and its checksum before anything is restored, so a truncated or corrupt checkpoint is
an `UnreadableCheckpoint` naming the file (`run_dir.py` refuses it, offering the previous good one).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_model
from torch import nn

from grpo_kernels.shown import shown
from grpo_kernels.trainer import atomic_write
from grpo_kernels.trainer.parallel import ParallelState, unwrap
from grpo_kernels.trainer.sampler_sync import valid_gaps

CHECKPOINTS = "checkpoints"
_PREFIX = "step_"
MODEL_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"  # what peft's save_pretrained writes for a LoRA policy
REF_MODEL_FILE = "ref_model.safetensors"
TRAINER_STATE_FILE = "trainer_state.pt"
CHECKSUMS_FILE = "checksums.json"  # the SHA-256 of every other file of the checkpoint
# the trainer state's "format": 2 since checksums.json is written with every checkpoint, which must then list every
# file (a checkpoint without the field was written before, and one without checksums.json is taken as it is)
CHECKPOINT_FORMAT = 2
_MODEL_PREFIX = "model."  # PolicyModule's name for the policy


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that is missing, truncated, corrupt, or holds more than tensors and plain data."""

    def __init__(self, file: Path, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason


class NonFiniteWeights(ValueError):
    """A checkpoint refused because a policy weight is NaN or infinite: no such checkpoint is ever written, so the
    latest one on disk stays the last good one."""


class CheckpointWriteError(OSError):
    """The file system refused a checkpoint write (file too large, read-only, I/O error, ...); its partial `.tmp/`
    folder is removed."""

    def __str__(self) -> str:
        return self.strerror


class DiskFull(CheckpointWriteError):
    """No space left on the device while writing a checkpoint (its partial `.tmp/` folder is removed)."""


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"{_PREFIX}{step:06d}"


def complete(output_dir: str | Path) -> list[Path]:
    """The renamed (complete) checkpoint directories, highest step first."""
    root = Path(output_dir) / CHECKPOINTS
    done = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX) :]), reverse=True)


def latest(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    return next(iter(complete(output_dir)), None)


def rng_state() -> dict:
    """The RNG states as tensors and plain data (loadable with `weights_only=True`)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    output_dir: str | Path,
    *,
    step: int,
    policy: nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    ref_model: nn.Module | None,
    data_state: dict,
    components_state: dict,
    config_dict: dict,
    parallel: ParallelState,
    sync_gaps: Sequence[float] = (),
) -> Path:
    """Write the checkpoint after `step` completed optimizer steps (every rank calls this); returns its directory.

    `policy` is the `PolicyModule`, bare or under DDP / FSDP2: model and optimizer state are gathered whole
    (FSDP2 shards are collected), rank 0 writes them, and each rank writes its own RNG states. A failure removes the
    `.tmp/` folder; no space left on the device is a `DiskFull` that says so. Everything after `output_dir` is
    passed by keyword: the two models and the three state mappings would each take the other's place silently.
    `sync_gaps`: the sampler-sync guard's mean gaps of the latest steps, which its trend rule reads on resume."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    final = checkpoint_dir(output_dir, step)
    check_weights_finite(unwrap(policy).model, parallel, final)
    tmp = final.with_name(final.name + ".tmp")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(policy, options=full) if parallel.mode == "fsdp" else None
    # an optimizer that has taken no step is saved as None: torch's state-dict helpers would first take a step
    # with zero gradients to create its state, which advances AdamW's step count and so changes the run's numbers
    optimizer_state = get_optimizer_state_dict(policy, optimizer, options=full) if optimizer.state else None
    try:
        if parallel.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            _save_models(tmp, unwrap(policy).model, model_state, tokenizer, ref_model)
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "optimizer": optimizer_state,
                "data": data_state,
                "components": components_state,
                "config": config_dict,
                "sync_gaps": [float(gap) for gap in sync_gaps],  # the guard's trend rule goes on where it was
            }
            _save_torch(state, tmp / TRAINER_STATE_FILE)
        _barrier(parallel)
        _save_torch(rng_state(), tmp / f"rng_rank{parallel.rank}.pt")
        _barrier(parallel)
        if parallel.is_main:
            write_checksums(tmp)
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            atomic_write.fsync(final.parent)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = _write_failure(error)
        if failure == errno.ENOSPC:
            raise DiskFull(
                errno.ENOSPC,
                f"no space left on the device while writing checkpoint {final} (its partial files are removed): "
                f"free space in {final.parent} (or checkpoint less often, --checkpoint-every), then --resume "
                "continues from the previous checkpoint",
            ) from error
        if failure is not None:
            raise CheckpointWriteError(
                failure,
                f"{os.strerror(failure).lower()} while writing checkpoint {final} (its partial files are removed; "
                f"errno {errno.errorcode.get(failure, failure)}): fix the file system's limit, then --resume "
                "continues from the previous checkpoint",
            ) from error
        raise
    _barrier(parallel)
    return final


def check_weights_finite(model: nn.Module, parallel: ParallelState, final: Path) -> None:
    """A `NonFiniteWeights` naming the first NaN / inf weight (on any rank: every rank refuses together)."""
    local = {name: getattr(p, "to_local", p.detach)() for name, p in model.named_parameters()}  # FSDP2: the shard
    bad = next((name for name, p in local.items() if not torch.isfinite(p.detach()).all()), None)
    if parallel.world_size > 1:
        flag = torch.tensor(float(bad is not None), device=parallel.device)
        dist.all_reduce(flag)
        bad = bad or ("a weight on another rank" if float(flag) > 0 else None)
    if bad is not None:
        raise NonFiniteWeights(
            f"checkpoint {final} not written: policy weight {bad} is not finite (NaN or inf); the previous "
            "checkpoint is kept"
        )


def read(path: str | Path, rank: int, *, lora: bool, ref_model: bool) -> dict:
    """Check every file of checkpoint `path` that this rank will load and read its `.pt` files: the trainer state
    (step, optimizer, data, components, config, the guard's sync_gaps) with this rank's RNG states under "rng".
    Nothing is restored yet. An `UnreadableCheckpoint` names the first file that is missing, truncated, corrupt, or
    not plain data."""
    path = Path(path)
    for name in [ADAPTER_FILE if lora else MODEL_FILE] + ([REF_MODEL_FILE] if ref_model else []):
        _check_safetensors(path / name)
    state = _load_torch(path / TRAINER_STATE_FILE)
    if not isinstance(state, dict) or not {"step", "optimizer", "data"} <= set(state):
        raise UnreadableCheckpoint(path / TRAINER_STATE_FILE, "not a trainer state (step, optimizer, data)")
    gaps = state.get("sync_gaps", [])  # absent before the guard's gaps were kept
    if not valid_gaps(gaps):
        raise UnreadableCheckpoint(path / TRAINER_STATE_FILE, f"sync_gaps must be gaps >= 0, got {shown(gaps)}")
    rng = _load_torch(path / f"rng_rank{rank}.pt")
    if not isinstance(rng, dict) or not {"torch", "python"} <= set(rng):
        raise UnreadableCheckpoint(path / f"rng_rank{rank}.pt", "not an RNG state (torch, python)")
    verify_checksums(path, required=_format(state) >= CHECKPOINT_FORMAT)
    return {**state, "rng": rng}


def verify(path: str | Path) -> None:
    """Check the checksums of trainer checkpoint `path` (one with a trainer state) as `read` does, for a reader that
    loads only its model (`grpo_kernels.evaluate`); any other directory passes."""
    path = Path(path)
    if (path / TRAINER_STATE_FILE).is_file():
        verify_checksums(path, required=_format(_load_torch(path / TRAINER_STATE_FILE)) >= CHECKPOINT_FORMAT)


def _format(state: object) -> int:
    """The checkpoint format a trainer state records (1: written before the field)."""
    value = state.get("format", 1) if isinstance(state, dict) else 1
    return value if isinstance(value, int) else 1


def write_checksums(directory: Path) -> None:
    """`<directory>/checksums.json`: the SHA-256 of every file under `directory` (by relative path)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS_FILE)
    sums = {p.relative_to(directory).as_posix(): _sha256(p) for p in files}
    (directory / CHECKSUMS_FILE).write_text(json.dumps(sums, indent=1), encoding="utf-8")


def verify_checksums(directory: Path, required: bool = False) -> None:
    """Every file `checksums.json` lists is there with its SHA-256, else an `UnreadableCheckpoint` naming the first
    that is not; names are relative paths inside the checkpoint (an absolute path or `..` is refused). A checkpoint
    without the file (written before checksums were kept) is taken as it is, unless `required` (its format writes
    one): then the file must be there and list every other file of the checkpoint."""
    listing = directory / CHECKSUMS_FILE
    if not listing.is_file():
        if required:
            raise UnreadableCheckpoint(listing, "missing (this checkpoint's format lists every file's SHA-256 there)")
        return
    try:
        sums = json.loads(listing.read_text(encoding="utf-8"))
        items = sorted(sums.items()) if isinstance(sums, dict) else None
    except (ValueError, UnicodeDecodeError) as error:
        raise UnreadableCheckpoint(listing, f"corrupt ({type(error).__name__})") from None
    if items is None or not all(isinstance(v, str) for _, v in items):
        raise UnreadableCheckpoint(listing, "corrupt (not a mapping of file names to SHA-256 digests)")
    for name, _ in items:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise UnreadableCheckpoint(listing, f"refused: it names {shown(name)}, outside the checkpoint")
    if required:
        unlisted = sorted(
            p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS_FILE and
            p.relative_to(directory).as_posix() not in sums
        )  # fmt: skip
        if unlisted:
            raise UnreadableCheckpoint(listing, f"partial: it does not list {unlisted[0].relative_to(directory)}")
    for name, digest in items:
        file = directory / name
        if not file.is_file():
            raise UnreadableCheckpoint(file, f"missing (listed in {CHECKSUMS_FILE})")
        if _sha256(file) != digest:
            raise UnreadableCheckpoint(file, f"checksum mismatch: its SHA-256 is not the one in {CHECKSUMS_FILE}")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_weights(path: str | Path, model: nn.Module, ref_model: nn.Module | None) -> None:
    """Restore the policy and reference weights of checkpoint `path` into the bare models (before any wrapping)."""
    path = Path(path)
    if (path / ADAPTER_FILE).is_file():  # a LoRA run: the adapters (peft's save_pretrained)
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(path / ADAPTER_FILE))
    else:
        load_model(model, str(path / MODEL_FILE))
    if ref_model is not None:
        load_model(ref_model, str(path / REF_MODEL_FILE))


def load_state(state: dict, policy: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore the optimizer and this rank's RNG states in place from `read`'s result."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if state["optimizer"] is not None:  # None: saved before the first step, nothing to restore
        set_optimizer_state_dict(policy, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    set_rng_state(state["rng"])


# ------------------------------------------------------------------------------------------------ files
def _save_models(tmp: Path, model: nn.Module, model_state: dict | None, tokenizer, ref_model) -> None:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar under the training bar
    try:
        if model_state is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict={k.removeprefix(_MODEL_PREFIX): v for k, v in model_state.items()})
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    if ref_model is not None:
        save_model(ref_model, str(tmp / REF_MODEL_FILE))


def _save_torch(obj, file: Path) -> None:
    """`torch.save` through a Python file, so that a failed write raises the OSError (ENOSPC, ...) behind it."""
    with open(file, "wb") as f:
        torch.save(obj, f)


def _load_torch(file: Path):
    if not file.is_file():
        raise UnreadableCheckpoint(file, "missing")
    try:
        return torch.load(file, weights_only=True)
    except Exception as error:  # noqa: BLE001 — any failure means this file cannot be used
        text = " ".join(str(error).split())
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            reason = (
                f"holds a reference to {found.group(1)}, not only tensors and plain data; refused (it could run code)"
            )
        else:
            detail = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
            first = detail.group(1) if detail else text.split(". ")[0][:200]
            reason = f"unreadable, truncated or corrupt ({type(error).__name__}: {first})"
        raise UnreadableCheckpoint(file, reason) from None


def _check_safetensors(file: Path) -> None:
    """The file's header parses and its tensors' data fit the file's size exactly (a truncated file fails)."""
    if not file.is_file():
        raise UnreadableCheckpoint(file, "missing")
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < header_size <= size - 8:
            raise UnreadableCheckpoint(file, f"truncated or corrupt: {size} bytes, no complete safetensors header")
        try:
            header = json.loads(f.read(header_size))
            end = max([t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"], default=0)
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise UnreadableCheckpoint(file, f"corrupt safetensors header ({error})") from None
    if 8 + header_size + end != size:
        raise UnreadableCheckpoint(
            file, f"truncated or corrupt: {size} bytes, its header needs {8 + header_size + end}"
        )


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then the directories: their contents reach the disk before the rename."""
    for directory, _, files in os.walk(root):
        for name in files:
            atomic_write.fsync(Path(directory) / name)
        atomic_write.fsync(Path(directory))


_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


def _write_failure(error: BaseException) -> int | None:
    """The errno of a file-system failure behind `error` (ENOSPC for a quota too), or None: writers wrap the OSError
    differently (torch.save: a RuntimeError whose context is the OSError; safetensors: the OS message in its own
    error)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for number in _WRITE_ERRORS:
            if (isinstance(error, OSError) and error.errno == number) or os.strerror(number) in str(error):
                return errno.ENOSPC if number == errno.EDQUOT else number
        error = error.__cause__ or error.__context__
    return None


def _barrier(parallel: ParallelState) -> None:
    if parallel.world_size > 1:
        dist.barrier()

"""Checkpoints: everything `--resume` needs to continue exactly as if the run had never stopped.

`<output_dir>/checkpoints/step_000050/` holds the policy as a Hugging Face directory (`model.safetensors`,
`config.json`, the tokenizer; with `--lora`, peft's adapter directory), the reference model
(`ref_model.safetensors`, when there is one), `trainer_state.pt` (step, the whole optimizer state, the prompt
stream's position) and `rng_rank<r>.pt` for each data-parallel rank (torch CPU and CUDA, Python). `step_000000` is
the initial policy.
A checkpoint is written to `step_XXXXXX.tmp/` and renamed when complete, so a run killed while saving leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file, load_model, save_model
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers.utils import logging as hf_logging

from grpo_kernels.trainer.parallel import ParallelState, unwrap

CHECKPOINTS = "checkpoints"
_PREFIX = "step_"
ADAPTER_FILE = "adapter_model.safetensors"  # what peft's save_pretrained writes for a LoRA policy
_MODEL_PREFIX = "model."  # PolicyModule's name for the policy


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"{_PREFIX}{step:06d}"


def latest(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    root = Path(output_dir) / CHECKPOINTS
    done = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return max(done, key=lambda p: int(p.name[len(_PREFIX) :]), default=None)


def save_config(output_dir: str | Path, config_dict: dict) -> Path:
    """`<output_dir>/config.yaml`: the run's full configuration, usable as `--config`."""
    path = Path(output_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_dict, sort_keys=False), encoding="utf-8")
    return path


def rng_state() -> dict:
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
    step: int,
    policy: nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    ref_model: nn.Module | None,
    data_state: dict,
    components_state: dict,
    config_dict: dict,
    parallel: ParallelState,
) -> Path:
    """Write the checkpoint after `step` completed optimizer steps (every rank calls this); returns its directory.

    `policy` is the `PolicyModule`, bare or under DDP / FSDP2: model and optimizer state are gathered whole
    (FSDP2 shards are collected), rank 0 writes them, and each rank writes its own RNG states."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(policy, options=full) if parallel.mode == "fsdp" else None
    optimizer_state = get_optimizer_state_dict(policy, optimizer, options=full)
    if parallel.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar under the training bar
        model = unwrap(policy).model
        if model_state is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict={k.removeprefix(_MODEL_PREFIX): v for k, v in model_state.items()})
        if bars:
            hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp)
        if ref_model is not None:
            save_model(ref_model, str(tmp / "ref_model.safetensors"))
        state = {
            "step": step,
            "optimizer": optimizer_state,
            "data": data_state,
            "components": components_state,
            "config": config_dict,
        }
        torch.save(state, tmp / "trainer_state.pt")
    _barrier(parallel)
    torch.save(rng_state(), tmp / f"rng_rank{parallel.rank}.pt")
    _barrier(parallel)
    if parallel.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    _barrier(parallel)
    return final


def load_weights(path: str | Path, model: nn.Module, ref_model: nn.Module | None) -> None:
    """Restore the policy and reference weights of checkpoint `path` into the bare models (before any wrapping)."""
    path = Path(path)
    if (path / ADAPTER_FILE).is_file():  # a LoRA run: the adapters (peft's save_pretrained)
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(path / ADAPTER_FILE))
    else:
        load_model(model, str(path / "model.safetensors"))
    if ref_model is not None:
        load_model(ref_model, str(path / "ref_model.safetensors"))


def load_state(path: str | Path, policy: nn.Module, optimizer: torch.optim.Optimizer, parallel: ParallelState) -> dict:
    """Restore the optimizer and this rank's RNG states in place; returns the trainer state (step, data,
    components)."""
    path = Path(path)
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    set_optimizer_state_dict(policy, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    set_rng_state(torch.load(path / f"rng_rank{parallel.rank}.pt", weights_only=False))
    return state


def _barrier(parallel: ParallelState) -> None:
    if parallel.world_size > 1:
        dist.barrier()

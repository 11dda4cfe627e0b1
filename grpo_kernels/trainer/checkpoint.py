"""Checkpoints: everything `--resume` needs to continue exactly as if the run had never stopped.

`<output_dir>/checkpoints/step_000050/` holds the policy as a Hugging Face directory (`model.safetensors`,
`config.json`, the tokenizer), the reference model (`ref_model.safetensors`, when there is one) and
`trainer_state.pt`: step, optimizer state, RNG states (torch CPU and CUDA, Python) and the prompt stream's position.
A checkpoint is written to `step_XXXXXX.tmp/` and renamed when complete, so a run killed while saving leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_model, save_model
from torch import nn
from transformers.utils import logging as hf_logging

CHECKPOINTS = "checkpoints"
_PREFIX = "step_"


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
    model: nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    ref_model: nn.Module | None,
    data_state: dict,
    config_dict: dict,
) -> Path:
    """Write the checkpoint after `step` completed optimizer steps; returns its directory."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar under the training bar
    model.save_pretrained(tmp)
    if bars:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    if ref_model is not None:
        save_model(ref_model, str(tmp / "ref_model.safetensors"))
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "data": data_state,
        "config": config_dict,
    }
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, ref_model: nn.Module | None) -> dict:
    """Restore model, reference model, optimizer and RNG states in place; returns the trainer state (step, data)."""
    path = Path(path)
    load_model(model, str(path / "model.safetensors"))
    if ref_model is not None:
        load_model(ref_model, str(path / "ref_model.safetensors"))
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return state

"""Trainer options beyond the demo's defaults, on the tiny demo policy (CPU): gradient accumulation gives the same
run as one batch, LoRA trains adapters only and resumes exactly, experiment trackers get every record (through
stand-in modules: tensorboard and wandb are optional), and a missing optional package is a clear error."""

import dataclasses
import sys
import types

import pytest
import torch

from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.checkpoint import checkpoint_dir
from grpo_kernels.trainer.logging import TIMES, MetricsLogger
from grpo_kernels.trainer.tasks import AdditionTask
from grpo_kernels.trainer.train import GRPOTrainer

QUIET = dict(progress=False, plot=False, eval_every=0)
TIMING = TIMES


def run(tmp_path, **overrides) -> tuple[GRPOTrainer, list[dict]]:
    config = dataclasses.replace(TrainConfig(), output_dir=str(tmp_path), steps=4, checkpoint_every=0, **QUIET)
    trainer = GRPOTrainer(dataclasses.replace(config, **overrides), task=AdditionTask())
    return trainer, trainer.train()


def without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in history]


@pytest.mark.parametrize("preset_loss", [dict(loss_type="grpo"), dict(loss_type="bnpo"), dict(loss_type="dapo")])
def test_gradient_accumulation_matches_one_batch(tmp_path, preset_loss):
    """4 micro-batches per update: the same losses, rewards and gradient norms, step after step (float tolerance)."""
    loss = dataclasses.replace(TrainConfig().loss, **preset_loss)
    _, whole = run(tmp_path / "whole", loss=loss)
    _, micro = run(tmp_path / "micro", loss=loss, gradient_accumulation_steps=4)
    for a, b in zip(without_timing(whole), without_timing(micro), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be in"):
        run(tmp_path / "bad", gradient_accumulation_steps=10_000)


def test_lora_trains_adapters_only_and_resumes_exactly(tmp_path):
    pytest.importorskip("peft")
    lora = dict(lora=True, lora_r=4, learning_rate=1e-2)
    trainer, _ = run(tmp_path / "a", steps=2, checkpoint_every=2, **lora)
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert (checkpoint_dir(tmp_path / "a", 2) / "adapter_model.safetensors").is_file()
    _, resumed = run(tmp_path / "a", steps=4, checkpoint_every=2, resume=True, **lora)
    _, straight = run(tmp_path / "b", steps=4, checkpoint_every=2, **lora)
    assert without_timing(resumed)[2:] == without_timing(straight)[2:]
    assert straight[-1]["grad_norm"] > 0


def test_lora_without_peft_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install 'grpo-kernels\[peft\]'"):
        run(tmp_path, lora=True)


class _Recorder:
    """Stands in for a SummaryWriter and a wandb run."""

    def __init__(self, *args, **kwargs) -> None:
        self.scalars, self.closed = [], False

    def add_scalar(self, name, value, step):
        self.scalars.append((step, name, value))

    def log(self, metrics, step):
        self.scalars += [(step, name, value) for name, value in metrics.items()]

    def close(self):
        self.closed = True

    finish = close


@pytest.mark.parametrize("report_to", ["tensorboard", "wandb"])
def test_trackers_get_every_record(tmp_path, monkeypatch, report_to):
    recorder = _Recorder()
    if report_to == "tensorboard":
        module = types.ModuleType("torch.utils.tensorboard")
        module.SummaryWriter = lambda log_dir: recorder
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    else:
        module = types.ModuleType("wandb")
        module.init = lambda **kwargs: recorder
        monkeypatch.setitem(sys.modules, "wandb", module)
    logger = MetricsLogger(tmp_path, 2, progress=False, report_to=report_to)
    logger.log(1, {"reward": 0.5, "kl": 0.1})
    logger.log(2, {"reward": 0.7})
    logger.close(plot=False)
    assert recorder.scalars == [(1, "reward", 0.5), (1, "kl", 0.1), (2, "reward", 0.7)] and recorder.closed


@pytest.mark.parametrize("report_to, package", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_tracker_without_its_package_is_a_clear_error(tmp_path, monkeypatch, report_to, package):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ImportError, match="pip install"):
        MetricsLogger(tmp_path, 1, progress=False, report_to=report_to)
    with pytest.raises(ValueError, match="report_to must be one of"):
        MetricsLogger(tmp_path, 1, progress=False, report_to="mlflow")


def test_parallel_options_need_torchrun(tmp_path):
    with pytest.raises(ValueError, match="needs several processes"):
        run(tmp_path, parallel="fsdp")
    with pytest.raises(ValueError, match="parallel must be one of"):
        run(tmp_path, parallel="deepspeed")
    assert torch.distributed.is_available()

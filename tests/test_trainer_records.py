"""The trainer's records and the calls that take many same-typed values are built by keyword: two float [B, T]
tensors, two models or two state mappings passed in the wrong order would run, so no positional form exists."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from grpo_kernels.trainer import checkpoint
from grpo_kernels.trainer.policy import UpdateBatch
from grpo_kernels.trainer.rollout import RolloutBatch
from grpo_kernels.trainer.step_records import StepSamples, StepWeights
from grpo_kernels.trainer.update import inner_updates


@pytest.mark.parametrize("record", [UpdateBatch, RolloutBatch, StepSamples, StepWeights], ids=lambda r: r.__name__)
def test_records_are_keyword_only(record):
    assert all(f.kw_only for f in dataclasses.fields(record)), record.__name__


def test_a_positional_update_batch_is_a_type_error():
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="positional"):
        UpdateBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), mask, torch.zeros(2), logp)


@pytest.mark.parametrize(
    "function, positional",
    [(inner_updates, ("policy", "optimizer", "batch")), (checkpoint.save, ("output_dir",))],
    ids=["inner_updates", "checkpoint.save"],
)
def test_calls_take_their_settings_by_keyword(function, positional):
    parameters = inspect.signature(function).parameters.values()
    assert tuple(p.name for p in parameters if p.kind is not p.KEYWORD_ONLY) == positional

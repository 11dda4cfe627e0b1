"""The rollout correction in the trainer: `--rollout-correction` takes a verl preset name or a YAML mapping of the
record's fields, replaces TRL's `vllm_importance_sampling_*` correction, and a tiny run (the demo policy, CPU)
trains with it, its metrics logged under verl's and NeMo's names; config.yaml records the record's fields."""

import dataclasses

import pytest

from grpo_kernels.rollout_correction import RolloutCorrection
from grpo_kernels.trainer.config import parse_args
from grpo_kernels.trainer.config.files import from_dict
from grpo_kernels.trainer.tasks import AdditionTask
from grpo_kernels.trainer.train import GRPOTrainer

QUIET = [
    "--no-progress",
    "--no-plot",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "4",
]


@pytest.mark.parametrize(
    "flag, bypass",
    (
        ("bypass_ppo_clip_k3_rs", True),
        (
            "{rollout_is: token, rollout_is_threshold: '0.5_2.0', rollout_rs: seq_mean_k3, rollout_rs_threshold: 0.1}",
            False,
        ),
    ),
    ids=("preset", "fields"),
)
def test_trainer_runs_with_the_correction(tmp_path, flag, bypass):
    args = ["--output-dir", str(tmp_path), "--steps", "2", "--rollout-correction", flag, *QUIET]
    config = parse_args(args)
    correction = config.loss.rollout_correction
    assert isinstance(correction, RolloutCorrection) and correction.bypass_mode is bypass
    history = GRPOTrainer(config, task=AdditionTask()).train()
    assert len(history) == 2
    for record in history:
        for name in ("rollout_corr/kl", "rollout_corr/chi2_seq", "rollout_corr/rollout_rs_masked_fraction"):
            assert name in record
        assert "rollout_corr/token_mult_prob_error" in record
    written = config.to_dict()["loss"]["rollout_correction"]
    assert from_dict({"loss": {"rollout_correction": written}}, config, where="test").loss == config.loss


def test_bad_flag_is_one_error(tmp_path):
    with pytest.raises(ValueError, match="rollout_correction preset must be one of"):
        parse_args(["--output-dir", str(tmp_path), "--rollout-correction", "bypass_ppo", *QUIET])


def test_reinforce_preset_needs_gpg(tmp_path):
    config = parse_args(["--output-dir", str(tmp_path), "--loss-type", "gpg", "--rollout-correction", "bypass_pg_is"])
    assert dataclasses.replace(config.loss).rollout_correction.rollout_is == "sequence"

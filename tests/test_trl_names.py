"""The loss options speak TRL: same names and defaults as TRL's own GRPOConfig, checked against the installed TRL.

Upgrading TRL makes these fail when a default moves, instead of silently diverging (issue: TRL names and defaults).
"""

import dataclasses
import inspect

import pytest

from grpo_kernels import GRPOLoss, grpo_loss, reference
from grpo_kernels.options import TRL_DEFAULT_DIFFERENCES, LossOptions

trl = pytest.importorskip("trl")

# GRPOConfig fields that change the loss of one batch (the rest are generation, advantage, schedule or logging
# settings); each must be a LossOptions field of the same name.
TRL_LOSS_FIELDS = (
    "loss_type",
    "epsilon",
    "epsilon_high",
    "delta",
    "beta",
    "temperature",
    "importance_sampling_level",
    "max_completion_length",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "use_bias_correction_kl",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "entropy_coef",
)

OURS = {f.name: f.default for f in dataclasses.fields(LossOptions)}


@pytest.fixture(scope="module")
def trl_config(tmp_path_factory):
    return trl.GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True)


def test_every_trl_loss_option_has_our_name(trl_config):
    missing = [name for name in TRL_LOSS_FIELDS if name not in OURS]
    assert not missing, f"TRL loss options without a LossOptions field of the same name: {missing}"
    assert all(hasattr(trl_config, name) for name in TRL_LOSS_FIELDS), "TRL dropped a loss option: update the list"


def test_shared_defaults_equal_trl_or_are_listed(trl_config):
    trl_fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    differ = {}
    for name in sorted(set(OURS) & trl_fields):
        theirs = getattr(trl_config, name)
        if name in TRL_DEFAULT_DIFFERENCES:
            ours_listed, theirs_listed, _why = TRL_DEFAULT_DIFFERENCES[name]
            assert (OURS[name], theirs) == (ours_listed, theirs_listed), f"{name}: the listed difference moved"
        elif OURS[name] != theirs:
            differ[name] = (OURS[name], theirs)
    assert not differ, f"defaults that differ from TRL {trl.__version__} (ours, TRL's): {differ}"
    assert set(TRL_DEFAULT_DIFFERENCES) <= trl_fields


def test_the_oracle_and_module_take_the_same_defaults():
    """reference.grpo_loss (the float64 oracle) states its defaults itself: they must be LossOptions'."""
    params = inspect.signature(reference.grpo_loss).parameters
    for name, default in OURS.items():
        if name in params:
            assert params[name].default == default, f"reference.grpo_loss({name}=...) default differs"
    assert GRPOLoss().options == LossOptions()


def test_trl_config_loss_arguments_go_straight_in(trl_config):
    """A TRL user's GRPOConfig loss arguments are accepted by name (the `epsilon` of TRL, not `epsilon_low`)."""
    import torch

    kwargs = {name: getattr(trl_config, name) for name in TRL_LOSS_FIELDS if name not in TRL_DEFAULT_DIFFERENCES}
    options = LossOptions.from_kwargs(**kwargs)
    assert options == LossOptions()
    logits = torch.randn(2, 3, 11)
    out = grpo_loss(logits, torch.randint(0, 11, (2, 3)), torch.randn(2), **kwargs)
    assert out.loss.isfinite()


def test_epsilon_low_is_an_alias_of_epsilon():
    assert LossOptions(epsilon_low=0.1) == LossOptions(epsilon=0.1)
    assert LossOptions(epsilon=0.1, epsilon_low=0.1).epsilon == 0.1
    assert dataclasses.replace(LossOptions(epsilon_low=0.1), epsilon=0.3).epsilon == 0.3
    with pytest.raises(ValueError, match="epsilon_low is an alias of epsilon"):
        LossOptions(epsilon=0.1, epsilon_low=0.3)

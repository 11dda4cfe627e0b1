"""The verl plugin leaves nothing half-done: `register()` checks its prefix, names and losses before it adds any
(all or nothing), `patch_fused_kernels` / `unpatch_fused_kernels` restore verl's function across reloads, and a
registered loss refuses a config that is not verl's actor config, or tensors of the wrong shape, in one line."""

import importlib
import sys
from types import ModuleType

import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos", reason='verl is not installed: pip install "grpo-kernels[verl]"'
)

from verl.utils.kernel import linear_cross_entropy as home  # noqa: E402

from grpo_kernels.integrations import verl as gk_verl  # noqa: E402
from tests.test_verl import actor_config, verl_inputs  # noqa: E402

B, T = 6, 9


@pytest.fixture
def registry():
    """verl's policy-loss registry, put back as it was after the test."""
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    yield core_algos.POLICY_LOSS_REGISTRY
    core_algos.POLICY_LOSS_REGISTRY.clear()
    core_algos.POLICY_LOSS_REGISTRY.update(before)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(prefix=""), ValueError, "already holds 'cispo'"),  # verl's names: refused before any is added
        (dict(prefix=None), TypeError, "prefix must be a str"),
        (dict(prefix=3), TypeError, "prefix must be a str"),
        (dict(prefix="gk dapo="), TypeError, "prefix must be a str of letters"),
        (dict(loss_types="dapo"), TypeError, "loss_types must be a tuple"),
        (dict(loss_types=("grpo", "nope")), ValueError, "loss_type must be one of"),
        (dict(delta=4.0), ValueError, "delta applies to"),  # valid for grpo, refused for cispo: none is added
    ],
)
def test_register_is_all_or_nothing(registry, kwargs, error, match):
    before = dict(registry)
    with pytest.raises(error, match=match):
        gk_verl.register(**kwargs)
    assert registry == before
    assert not any(name.startswith("None") for name in registry)


def test_register_names_every_taken_name_and_is_idempotent(registry):
    with pytest.raises(ValueError) as info:
        gk_verl.register(loss_types=("grpo", "gpg", "dro"), prefix="")
    assert "'gpg'" in str(info.value) and "'dro'" in str(info.value) and "'grpo'" not in str(info.value)
    names = gk_verl.register(loss_types=("dapo", "dro"), prefix="x.")
    size = len(registry)
    assert gk_verl.register(loss_types=("dapo", "dro"), prefix="x.") == names == ("x.dapo", "x.dro")
    assert len(registry) == size and registry["x.dro"].grpo_kernels_loss_type == "dro"


@pytest.fixture
def importer(monkeypatch):
    """A verl module that imported verl's function before any patch (as Megatron's fused forwards do)."""
    module = ModuleType("verl._gk_test_importer")
    module.linear_cross_entropy = home.linear_cross_entropy
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_patch_survives_a_reload_of_this_module(importer):
    original = home.linear_cross_entropy
    module = gk_verl
    try:
        module.patch_fused_kernels()
        module = importlib.reload(module)  # a new linear_cross_entropy, and this module's state starts afresh
        module.patch_fused_kernels()
        assert home.linear_cross_entropy is module.linear_cross_entropy is importer.linear_cross_entropy
    finally:
        module.unpatch_fused_kernels()
    assert home.linear_cross_entropy is original and importer.linear_cross_entropy is original
    module.unpatch_fused_kernels()  # nothing patched: nothing to do
    assert home.linear_cross_entropy is original


def test_patch_survives_a_reload_of_verls_module(importer):
    try:
        gk_verl.patch_fused_kernels()
        importlib.reload(home)  # verl's module puts a fresh function of its own back
        reloaded = home.linear_cross_entropy
        assert reloaded is not gk_verl.linear_cross_entropy
        gk_verl.patch_fused_kernels()
        assert home.linear_cross_entropy is gk_verl.linear_cross_entropy is importer.linear_cross_entropy
    finally:
        gk_verl.unpatch_fused_kernels()
    assert home.linear_cross_entropy is reloaded and importer.linear_cross_entropy is reloaded


def call(config="default", **overrides):
    inputs = {**verl_inputs(1), "rollout_is_weights": None, **overrides}
    config = actor_config("token-mean") if config == "default" else config
    return gk_verl.policy_loss_fn("dapo")(**inputs, loss_agg_mode="token-mean", config=config)


@pytest.mark.parametrize(
    "config,error,match",
    [
        ("fsdp", TypeError, "config must be verl's actor config .* got str"),
        ([0.2], TypeError, "config must be verl's actor config .* got list"),
        (None, TypeError, "got NoneType"),
        ({"clip_ratio": "0.2"}, TypeError, r"config.clip_ratio must be a number, got str"),
        ({"clip_ratio_high": True}, TypeError, r"config.clip_ratio_high must be a number, got bool"),
        ({"policy_loss": "vanilla"}, TypeError, "config.policy_loss must be a mapping"),
        ({"global_batch_info": {"dp_size": "2"}}, TypeError, "config.global_batch_info.dp_size must be a number"),
    ],
)
def test_registered_loss_refuses_a_config_that_is_not_verls(config, error, match):
    with pytest.raises(error, match=match) as info:
        call(config)
    assert "\n" not in str(info.value)


def test_registered_dro_names_its_beta():
    fn = gk_verl.policy_loss_fn("dro")
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match=r"config.policy_loss.dro_beta > 0"):
            fn(**verl_inputs(1), config=actor_config("token-mean", policy_loss=dict(dro_beta=beta)))


@pytest.mark.parametrize(
    "name,shape",
    [
        ("advantages", (B + 1, T)),  # the wrong length
        ("advantages", (B, T + 1)),
        ("advantages", (B - 1,)),
        ("rollout_is_weights", (B, T - 1)),
        ("old_log_prob", (B, T - 1)),
        ("response_mask", (B + 1, T)),
        ("log_prob", (B * T,)),
    ],
)
def test_registered_loss_names_a_tensor_of_the_wrong_shape(name, shape):
    with pytest.raises(ValueError, match=f"{name} must be") as info:
        call(**{name: torch.ones(shape)})
    assert "\n" not in str(info.value) and str(list(shape)) in str(info.value)


def test_registered_loss_takes_per_sequence_advantages_and_weights():
    inputs = verl_inputs(1)
    loss, _ = call(advantages=inputs["advantages"][:, 0], rollout_is_weights=inputs["rollout_is_weights"][:, :1])
    assert torch.isfinite(loss)
    with pytest.raises(TypeError, match="advantages must be a torch.Tensor, got list"):
        call(advantages=[1.0] * B)

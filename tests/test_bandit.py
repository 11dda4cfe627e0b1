"""The bandit example (examples/bandit.py): GRPO's loss and advantage on a non-LLM policy converge to the best arm
although every arm's reward drifts."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bandit.py"


@pytest.fixture(scope="module")
def bandit():
    spec = importlib.util.spec_from_file_location("bandit_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("seed", [0, 1])
def test_bandit_converges_to_the_best_arm(bandit, seed):
    config = bandit.BanditConfig(seed=seed)
    history = bandit.train(config)
    assert history[0]["p_best"] == pytest.approx(1 / config.arms, abs=0.1)  # starts near uniform
    assert next(h["step"] for h in history if h["p_best"] > 0.9) < 100
    assert min(h["p_best"] for h in history[-50:]) > 0.9  # and stays there while the rewards drift


def test_bandit_rewards_drift(bandit):
    config = bandit.BanditConfig()
    arms = bandit.DriftingBandit(config, torch.Generator().manual_seed(0))
    pulls = torch.arange(config.arms)
    levels = [arms.score(pulls, step).mean().item() for step in range(config.steps)]
    assert max(levels) - min(levels) > 2 * config.gap  # the common level moves by more than the gaps between arms
    assert arms.means(0).argmax() == arms.means(57).argmax() == arms.best_arm  # but the best arm stays the best

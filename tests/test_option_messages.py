"""One message per bad value of an option that several entry points take (`grpo_kernels.option_checks`): every
public function, the module, LossOptions and the TRL and verl drop-ins say the same thing for the same value."""

from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.option_checks import OPTION_RULES

B, T, V, H = 2, 3, 7, 4
LOGITS, HIDDEN, WEIGHT = torch.randn(B, T, V), torch.randn(B, T, H), torch.randn(V, H)
TARGETS, ADVANTAGES = torch.zeros(B, T, dtype=torch.long), torch.ones(B)

ENTRY_POINTS = {
    "token_logprobs": lambda **kw: gk.token_logprobs(LOGITS, TARGETS, **kw),
    "fused_linear_token_logprobs": lambda **kw: gk.fused_linear_token_logprobs(HIDDEN, WEIGHT, TARGETS, **kw),
    "grpo_loss": lambda **kw: gk.grpo_loss(LOGITS, TARGETS, ADVANTAGES, **kw),
    "fused_linear_grpo_loss": lambda **kw: gk.fused_linear_grpo_loss(HIDDEN, WEIGHT, TARGETS, ADVANTAGES, **kw),
    "LossOptions": lambda **kw: gk.LossOptions(**kw),
    "GRPOLoss": lambda **kw: gk.GRPOLoss(**kw)(LOGITS, TARGETS, ADVANTAGES),
}

BAD = [  # (option, value, error, message)
    ("min_p", math.nan, ValueError, "min_p must be in [0, 1) (0.0: off), got nan"),
    ("min_p", 1.0, ValueError, "min_p must be in [0, 1) (0.0: off), got 1.0"),
    ("min_p", "0.1", TypeError, "min_p must be a float, got str '0.1'"),
    ("top_p", math.inf, ValueError, "top_p must be in (0, 1] (1.0: off), got inf"),
    ("top_p", 0.0, ValueError, "top_p must be in (0, 1] (1.0: off), got 0.0"),
    ("top_k", 1.5, TypeError, "top_k must be an int, got float 1.5"),
    ("top_k", True, TypeError, "top_k must be an int, got bool True"),
    ("top_k", -1, ValueError, "top_k must be an int >= 0 (0: off), got -1"),
    ("temperature", 0.0, ValueError, "temperature must be > 0 and finite, got 0.0"),
    ("temperature", math.nan, ValueError, "temperature must be > 0 and finite, got nan"),
    ("temperature", "1", TypeError, "temperature must be a float, got str '1'"),
    ("logit_scale", -math.inf, ValueError, "logit_scale must be > 0 and finite, got -inf"),
    ("final_logit_softcapping", 0, ValueError, "final_logit_softcapping must be > 0 and finite, or None, got 0"),
]


def _message(call, **kwargs) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as caught:
        call(**kwargs)
    return caught.type, str(caught.value)


@pytest.mark.parametrize(("option", "value", "error", "message"), BAD, ids=[f"{o}={v!r}" for o, v, *_ in BAD])
def test_every_entry_point_gives_one_message_per_bad_value(option, value, error, message):
    assert option in OPTION_RULES
    for name, call in ENTRY_POINTS.items():
        assert _message(call, **{option: value}) == (error, message), name


@pytest.mark.parametrize(("option", "value", "error", "message"), [c for c in BAD if c[0] in ("top_k", "top_p")])
def test_verl_gives_the_same_messages(option, value, error, message):
    verl = pytest.importorskip("grpo_kernels.integrations.verl")
    call = lambda **kw: verl.linear_cross_entropy(HIDDEN, WEIGHT, TARGETS, **kw)  # noqa: E731
    assert _message(call, **{option: value}) == (error, message)
    if option != "top_k" or value != -1:  # verl's rollout config takes -1 as off
        assert _message(verl.rollout_rule, rollout={option: value}) == (error, f"rollout.{message}")


@pytest.mark.parametrize(("option", "value", "error", "message"), [c for c in BAD if c[0].endswith("_p")])
def test_the_trl_drop_in_reads_its_config_with_the_same_messages(option, value, error, message):
    pytest.importorskip("trl")
    import trl

    from grpo_kernels.integrations import trl_replay

    config = trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    config.generation_kwargs = {option: value}  # the config's own checks of these fields are TRL's
    assert _message(trl_replay.sampling_rule, args=config) == (error, message)

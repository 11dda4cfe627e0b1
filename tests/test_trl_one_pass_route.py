"""The TRL drop-in's one pass takes the fused loss's route where it serves: one `fused_linear_grpo_loss` call that
forms TRL's correction from its own log-probs (no π_old given), not the log-probs with gradients and TRL's algebra;
a token the sampler could not score keeps TRL's algebra (`trl_one_pass` module docstring)."""

import pytest
import torch

trl = pytest.importorskip("trl")

from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.integrations import trl_one_pass  # noqa: E402
from grpo_kernels.losses.sampler_ratio import SamplerCorrection  # noqa: E402
from tests.test_trl_one_pass import generate_and_update, model_dir  # noqa: E402, F401  (fixture)


def test_the_one_pass_is_the_fused_loss_with_trls_correction(monkeypatch, model_dir):  # noqa: F811
    calls, fused = [], drop_in.fused_linear_grpo_loss

    def recorded(*args, **kwargs):
        calls.append((kwargs.get("old_logp"), kwargs.get("sampler_correction")))
        return fused(*args, **kwargs)

    monkeypatch.setattr(drop_in, "fused_linear_grpo_loss", recorded)
    monkeypatch.setattr(trl_one_pass, "correct", lambda *_: pytest.fail("TRL's algebra ran"))
    generate_and_update(model_dir, True, vllm_importance_sampling_mode="token_truncate")
    assert len(calls) == 1 and calls[0][0] is None
    assert calls[0][1] == SamplerCorrection("token_truncate", None, 3.0)


def test_a_token_the_sampler_could_not_score_keeps_trls_algebra():
    inputs = {"sampling_per_token_logps": torch.tensor([[0.0, float("nan")]])}
    trainer = type("Trainer", (), {"top_entropy_quantile": 1.0, "args": object()})()
    assert not trl_one_pass.fuses_correction(trainer, inputs)
    assert trl_one_pass.fuses_correction(trainer, {"sampling_per_token_logps": torch.zeros(1, 2)})

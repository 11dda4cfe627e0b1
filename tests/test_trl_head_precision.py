"""The TRL drop-in's head precision against stock TRL 1.16: `cast_lm_head_to_fp32` maps onto head_precision="fp32",
and `grpo_kernels.integrations.trl.GRPOConfig(head_precision=...)` reaches the fused head."""

import pytest
import torch

trl = pytest.importorskip("trl")

import tests.test_trl as base  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from tests.conftest import assert_close  # noqa: E402
from tests.test_trl import T, assert_same, build, make_inputs, pair, step  # noqa: E402

model_path, tokenizer = base.model_path, base.tokenizer  # test_trl's fixtures: its tiny models and tokenizer


def test_cast_lm_head_to_fp32_under_bf16_autocast(model_path, tokenizer):
    """float32 weights, bf16 autocast (bf16=True): with cast_lm_head_to_fp32 both heads compute in float32, so
    loss, the head's gradients and metrics agree at float32 tolerance (the layers below, bf16 under autocast, at
    bf16's); without it the drop-in's head is bf16."""
    stock, ours = pair(model_path, tokenizer, loss_type="dapo", bf16=True, cast_lm_head_to_fp32=True)
    assert drop_in.head_precision(ours.args) == "fp32"
    inputs = make_inputs(stock)
    assert_same(stock, ours, inputs, layers_dtype=torch.bfloat16)
    bf16_head = build(drop_in.GRPOTrainer, model_path(), tokenizer, loss_type="dapo", bf16=True)
    logp_fp32, logp_bf16 = logprobs(ours, inputs), logprobs(bf16_head, inputs)
    assert_close(logp_fp32, logprobs(stock, inputs), torch.float32, "logp")
    assert (logp_fp32 - logp_bf16).abs().max() > 1e-4  # the bf16 rounding of the logits (4e-4 here)


def test_head_precision_of_a_bf16_model(model_path, tokenizer, monkeypatch):
    """A bf16 model: GRPOConfig(head_precision="fp32") gives float32 logits, as stock TRL's cast_lm_head_to_fp32,
    so the loss and the log-prob pass agree at float32 tolerance (the gradient GEMMs stay bf16 in the drop-in)."""
    bf16 = dict(loss_type="dapo", model_init_kwargs={"dtype": torch.bfloat16})
    stock = build(trl.GRPOTrainer, model_path(), tokenizer, cast_lm_head_to_fp32=True, **bf16)
    ours = build_ours(monkeypatch, model_path(), tokenizer, head_precision="fp32", **bf16)
    assert ours.model.dtype == torch.bfloat16
    inputs = make_inputs(stock)
    assert_close(step(ours, inputs)[0], step(stock, inputs)[0], torch.float32, "loss")
    assert_close(logprobs(ours, inputs), logprobs(stock, inputs), torch.float32, "logp")


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(head_precision="bf16", cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32=True asks for a float32 head"),
        (dict(head_precision="fp16"), "head_precision must be one of"),
    ],
)
def test_bad_head_precision_raises_at_construction(model_path, tokenizer, monkeypatch, changes, match):
    with pytest.raises(ValueError, match=match):
        build_ours(monkeypatch, model_path(), tokenizer, **changes)


def build_ours(monkeypatch, path, tokenizer, **config):
    """test_trl's `build` of the drop-in with its config a `drop_in.GRPOConfig` (which takes head_precision)."""
    monkeypatch.setattr(trl, "GRPOConfig", drop_in.GRPOConfig)
    return build(drop_in.GRPOTrainer, path, tokenizer, **config)


def logprobs(trainer, inputs):
    """The trainer's log-prob pass (old / reference log-probs) on the batch's sequences: [B, T]."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, T)[0]

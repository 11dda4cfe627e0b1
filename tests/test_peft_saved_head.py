"""PEFT's saved lm_head (`modules_to_save=["lm_head"]`, a `ModulesToSaveWrapper`): the fused head reads the active
adapter's trained copy, the frozen original while adapters are disabled (TRL's reference pass), and the TRL drop-in
trains it as stock TRL 1.16 does."""

import math

import pytest
import torch

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

import tests.test_trl as base  # noqa: E402
from grpo_kernels.integrations import hf  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from tests.conftest import assert_close  # noqa: E402
from tests.test_trl import TIMING, build  # noqa: E402

model_path, tokenizer = base.model_path, base.tokenizer  # test_trl's fixtures: its tiny models and tokenizer


def saved_head_lora():
    return peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"
    )


def test_lm_head_is_the_copy_in_use(model_path):
    """hf.lm_head gives the active adapter's copy, the original with adapters disabled, and the gradient of a
    fused log-prob pass reaches the copy only."""
    model = peft.get_peft_model(base.transformers.AutoModelForCausalLM.from_pretrained(model_path()), saved_head_lora())
    inner = model.get_base_model()
    wrapper = inner.get_output_embeddings()
    trained, frozen = wrapper.modules_to_save["default"], wrapper.original_module
    assert isinstance(wrapper, peft.utils.other.ModulesToSaveWrapper)
    assert hf.lm_head(inner)[0] is trained.weight and hf.lm_head(inner)[1] is trained.bias
    with model.disable_adapter():
        assert hf.lm_head(inner)[0] is frozen.weight
    ids = torch.randint(4, inner.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    attention, completion = torch.ones_like(ids), torch.ones(2, 4, dtype=torch.long)
    hf.policy_logprobs(inner, ids, attention, completion).sum().backward()
    assert trained.weight.grad is not None and trained.weight.grad.abs().sum() > 0
    assert frozen.weight.grad is None and not frozen.weight.requires_grad


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trains_the_saved_head_as_trl(model_path, tokenizer, beta):
    """LoRA with a trained lm_head, 2 optimizer steps with HF generation, same seed: stock TRL and the drop-in log
    the same loss and grad_norm (every logged number but the timings), end with the same trained head and LoRA
    weights, and leave the original head as it was. With beta the reference log-probs come from the base model
    with adapters disabled, hence from the frozen original head."""
    config = dict(max_steps=2, logging_steps=1, learning_rate=1e-2, beta=beta, loss_type="dapo")
    runs = []
    for cls in (trl.GRPOTrainer, drop_in.GRPOTrainer):
        trainer = build(cls, model_path(), tokenizer, saved_head_lora(), **config)
        wrapper = trainer.model.get_base_model().get_output_embeddings()
        original = wrapper.original_module.weight.detach().clone()
        trainer.train()
        assert torch.equal(wrapper.original_module.weight, original), "the frozen lm_head changed"
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert (trained["base_model.model.lm_head.modules_to_save.default.weight"] - original).abs().max() > 1e-4
        runs.append((trainer.state.log_history, trained))
    (stock_logs, stock_weights), (logs, weights) = runs
    assert len(stock_logs) == len(logs) == 3  # 2 steps + the train summary
    for a, b in zip(stock_logs, logs, strict=True):
        assert set(a) == set(b), f"logged names differ: {set(a) ^ set(b)}"
        for name, value in a.items():
            if name not in TIMING:
                assert math.isclose(b[name], value, rel_tol=1e-4, abs_tol=1e-5), f"{name}: {b[name]} != {value}"
    assert "grad_norm" in stock_logs[0] and (beta == 0.0 or "kl" in stock_logs[0])
    assert set(weights) == set(stock_weights)
    for name, value in stock_weights.items():
        assert_close(weights[name], value, torch.float32, name)

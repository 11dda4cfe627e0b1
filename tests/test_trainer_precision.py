"""The trainer in float16 and with dropout: runs that used to be lost.

- float16 parameters take AdamW's step on float32 master weights and moments: torch's AdamW kept in float16 rounds
  its eps to 0 and turns every weight with a zero gradient element into NaN at the first step.
- No checkpoint holds a non-finite weight.
- Generation and the scoring passes run in eval mode, so a model with dropout trains without a false stale-sampler
  stop; `disable_dropout` (TRL's name) zeroes every dropout, the attention modules' float rates included."""

import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.checkpoint import NonFiniteWeights, checkpoint_dir
from grpo_kernels.trainer.dropout import active_dropout, disable_dropout
from grpo_kernels.trainer.model import load_policy
from grpo_kernels.trainer.optimizer import MasterWeightAdamW, build_optimizer
from grpo_kernels.trainer.sampler_sync import LOGP_DIFFERENCE
from grpo_kernels.trainer.settings import resolve_settings
from grpo_kernels.trainer.tasks import build_task
from grpo_kernels.trainer.train import GRPOTrainer

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, prompts_per_step=2, num_generations=2, eval_every=0)
TINY.update(progress=False, plot=False)


def tiny(output_dir, **overrides) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), output_dir=str(output_dir), **{**TINY, **overrides})


def run_steps(optimizer_class, param: torch.Tensor, grads: list[torch.Tensor], **options) -> torch.Tensor:
    """`param` after one optimizer step per gradient."""
    param = torch.nn.Parameter(param.clone())
    optimizer = optimizer_class([param], **options)
    for grad in grads:
        param.grad = grad.to(param.dtype)
        optimizer.step()
    return param.detach()


def gradients(steps: int = 5) -> list[torch.Tensor]:
    """Random gradients with exact zeros, where AdamW's denominator is its eps alone."""
    torch.manual_seed(0)
    return [torch.randn(64) * (torch.rand(64) > 0.3) for _ in range(steps)]


def test_master_weights_take_torch_adamw_step_on_float32():
    """On float32 parameters the update is torch.optim.AdamW's (decoupled decay, bias correction)."""
    start, options = torch.randn(64), dict(lr=1e-2, weight_decay=0.1)
    ours = run_steps(MasterWeightAdamW, start, gradients(), **options)
    torch_adamw = run_steps(torch.optim.AdamW, start, gradients(), foreach=False, **options)
    torch.testing.assert_close(ours, torch_adamw, rtol=1e-6, atol=1e-7)


def test_float16_parameters_stay_finite_and_follow_the_float32_run():
    start = torch.randn(64)
    assert not torch.isfinite(run_steps(torch.optim.AdamW, start.half(), gradients(), lr=1e-3)).all()  # the bug
    half = run_steps(MasterWeightAdamW, start.half(), gradients(), lr=1e-3)
    full = run_steps(torch.optim.AdamW, start, gradients(), lr=1e-3)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), full, rtol=0, atol=2e-3)  # float16 rounding of |w| < 4


def test_build_optimizer_picks_master_weights_for_float16_only():
    assert type(build_optimizer([torch.nn.Parameter(torch.ones(2).half())], lr=1.0, weight_decay=0.0)) is (
        MasterWeightAdamW
    )
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.ones(2, dtype=dtype))]
        assert type(build_optimizer(params, lr=1.0, weight_decay=0.0)) is torch.optim.AdamW


def test_float16_run_keeps_finite_weights_and_resumes(tmp_path):
    """`--dtype float16`, a checkpoint each step: every saved weight is finite, and `--resume` continues."""
    history = GRPOTrainer(tiny(tmp_path, steps=3, checkpoint_every=1, dtype="float16")).train()
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in history)
    resumed = GRPOTrainer(tiny(tmp_path, steps=4, checkpoint_every=1, dtype="float16", resume=True))
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())
    state = resumed.optimizer.state[next(resumed.model.parameters())]
    assert state["master"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
    resumed.train()
    assert checkpoint_dir(tmp_path, 4).is_dir()


def test_a_checkpoint_with_a_nonfinite_weight_is_never_written(tmp_path):
    trainer = GRPOTrainer(tiny(tmp_path, steps=1, checkpoint_every=0))
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    with pytest.raises(NonFiniteWeights, match=r"model\.norm\.weight is not finite"):
        trainer.save_checkpoint()
    assert not checkpoint_dir(tmp_path, 0).exists() and not checkpoint_dir(tmp_path, 0).with_suffix(".tmp").exists()


def policy_of(config: TrainConfig):
    """(model, tokenizer) the trainer would build for `config`, for a test to change before the trainer takes it."""
    task = build_task(config)
    return load_policy(resolve_settings(config, task.max_completion_length), task)


def with_dropout(model: torch.nn.Module, rate: float = 0.3) -> None:
    for module in model.modules():
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = rate


def test_a_model_with_dropout_trains_without_a_false_stale_sampler_stop(tmp_path):
    """Dropout on every attention of a model in train mode: generation, π_old and the sampler-sync guard see the
    eval-mode policy, so the fp32 run's sampler log-probs equal π_old's after each update (it used to stop as a
    failed push); π_old keeps its own pass, since the update pass's log-probs carry dropout."""
    config = tiny(tmp_path, steps=3, checkpoint_every=0, hidden_size=32, num_heads=4, old_logprobs="auto")
    model, tokenizer = policy_of(config)
    with_dropout(model.train())
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    assert trainer.old_logp_source == "pass"
    history = trainer.train()
    assert len(history) == 3 and all(record[f"{LOGP_DIFFERENCE}/max"] < 1e-5 for record in history)
    assert not trainer.model.training  # left in eval mode: what a caller samples from next sees no dropout


def test_disable_dropout_zeroes_every_rate():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8))
    with_dropout(model)
    assert active_dropout(model)  # GPT-2's nn.Dropout modules (and here a float rate)
    disable_dropout(model)
    assert active_dropout(model) == {}


def test_disable_dropout_option_gives_the_update_pass_pi_old(tmp_path):
    config = tiny(tmp_path, steps=1, checkpoint_every=0, disable_dropout=True, old_logprobs="auto")
    model, tokenizer = policy_of(config)
    with_dropout(model)
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    assert active_dropout(trainer.model) == {} and trainer.old_logp_source == "update"

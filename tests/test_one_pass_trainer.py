"""One pass per step in the trainer, on the tiny demo with the stand-in vLLM (`tests/fake_vllm.py`, its CPU build, so
that generation does not run the policy and every forward of the policy's decoder counted is a training-phase one):
the π_old pass runs only where a component needs π_old before the update, the reference pass only with β ≠ 0, the
one-pass run logs the two-pass run's numbers, a sabotaged weight push still stops at step 1 before the optimizer
step, verl's bypass mode, and the guard's settings (`--sampler-sync`, its tolerance, the dropout it names)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_kernels.trainer import vllm_rollout
from grpo_kernels.trainer.components import PresetComponents
from grpo_kernels.trainer.config import apply_preset, parse_args
from grpo_kernels.trainer.dropout import dropout_settings
from grpo_kernels.trainer.logging import PHASES, TIMES, MetricsLogger
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.old_logprobs import old_logp_source, pass_reasons
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.sampler_sync import StaleSampler, check_sampler_sync
from grpo_kernels.trainer.tasks import AdditionTask
from grpo_kernels.trainer.train import GRPOTrainer
from tests.vllm_engine_cases import install_stand_in_cpu_build, vllm_demo

DIFF = "sampling/sampling_logp_difference"


@pytest.fixture
def cpu_vllm(monkeypatch):
    install_stand_in_cpu_build(monkeypatch)
    return monkeypatch


def forwards(model: torch.nn.Module | None) -> list[bool]:
    """A list that gets, at each forward of `model`'s decoder, whether gradients were on."""
    calls: list[bool] = []
    if model is not None:
        model.get_decoder().register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return calls


@pytest.mark.parametrize(
    "overrides, source, policy_calls",
    [
        (dict(old_logprobs="auto", loss=dict(beta=0.0)), "update", [True]),
        (dict(), "update", [True]),
        (dict(old_logprobs="auto", gradient_accumulation_steps=2), "update", [True, True]),
        (dict(old_logprobs="pass"), "pass", [False, True]),
        (dict(old_logprobs="auto", num_iterations=2), "pass", [False, True, True]),
        (dict(old_logprobs="sampler", num_iterations=2), "sampler", [True, True]),
    ],
    ids=["one_pass_beta_0", "default_one_pass", "accumulation", "pass", "mu_2", "bypass_mu_2"],
)
def test_the_pi_old_pass_runs_only_where_needed(cpu_vllm, tmp_path, overrides, source, policy_calls):
    overrides = dict(overrides)
    loss = overrides.pop("loss", {})
    config = vllm_demo(tmp_path, **overrides)
    trainer = GRPOTrainer(dataclasses.replace(config, loss=dataclasses.replace(config.loss, **loss)))
    beta = trainer.options.beta
    assert trainer.old_logp_source == source
    assert (trainer.ref_model is None) == (beta == 0.0)  # β = 0: no reference model, so no reference pass
    policy, reference = forwards(trainer.model), forwards(trainer.ref_model)
    trainer.step = 1
    metrics = trainer.training_step()
    assert policy == policy_calls  # the no-grad forward is the π_old pass; each update pass has gradients
    assert reference == ([] if beta == 0.0 else [False])
    assert all(f"time/{phase}" in metrics for phase in PHASES)


def test_a_one_pass_run_logs_the_two_pass_runs_numbers(cpu_vllm, tmp_path):
    """Two steps with two micro-batches each: every metric but the times is the same float, the guard's too (the π_old
    pass runs the update's micro-batches, so its log-probs are the update pass's bitwise)."""
    runs = []
    for old_logprobs in ("pass", "auto"):
        config = vllm_demo(tmp_path / old_logprobs, old_logprobs=old_logprobs, gradient_accumulation_steps=2)
        runs.append(GRPOTrainer(config).train())
    for two, one in zip(*runs, strict=True):
        assert one.keys() == two.keys() and f"{DIFF}/mean" in one
        for key in set(one) - set(TIMES):
            assert one[key] == two[key], key


@pytest.mark.parametrize("old_logprobs", ["auto", "sampler"])
def test_a_push_that_does_nothing_stops_the_one_pass_run_at_step_1_before_its_optimizer_step(
    cpu_vllm, tmp_path, old_logprobs
):
    cpu_vllm.setattr(vllm_rollout, "push_weights", lambda llm, weights, official: None)  # sabotaged
    trainer = GRPOTrainer(vllm_demo(tmp_path, old_logprobs=old_logprobs, gradient_accumulation_steps=2))
    assert trainer.old_logp_source == {"auto": "update", "sampler": "sampler"}[old_logprobs]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(StaleSampler, match=r"^step 1: the sampler's log-probs .* a weight push did not reach it$"):
        trainer.train()
    assert trainer.step == 1
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))  # no step taken


@pytest.mark.parametrize("sampler_sync", ["warn", "off"])
def test_warn_and_off_let_a_stale_sampler_train_on(cpu_vllm, tmp_path, capsys, sampler_sync):
    cpu_vllm.setattr(vllm_rollout, "push_weights", lambda llm, weights, official: None)
    history = GRPOTrainer(vllm_demo(tmp_path, sampler_sync=sampler_sync)).train()
    assert [r["step"] for r in history] == [1, 2] and history[-1][f"{DIFF}/mean"] > 1e-3  # logged all the same
    warned = "warning: step 2: the sampler's log-probs" in capsys.readouterr().out
    assert warned == (sampler_sync == "warn")


def test_the_tolerance_flag_sets_the_guards_limit(cpu_vllm, tmp_path):
    trainer = GRPOTrainer(vllm_demo(tmp_path, sampler_sync_tolerance=1e-9))
    assert trainer.sampler_tolerance == 1e-9
    with pytest.raises(StaleSampler, match=r"^step \d: .* the limit is 1e-09"):  # fp32 noise is over 1e-9
        trainer.train()


def test_the_guard_names_the_policys_dropout_as_a_possible_cause():
    tiny = build_tiny_llama(build_tokenizer("0123456789+="), hidden_size=64, num_layers=1, num_heads=2, max_length=8)
    assert dropout_settings(tiny) == ()
    tiny.config.attention_dropout = tiny.model.layers[0].self_attn.attention_dropout = 0.1
    assert dropout_settings(tiny) == ("attention_dropout=0.1",)
    gap = {f"{DIFF}/mean": 0.01, f"{DIFF}/max": 0.5}
    with pytest.raises(StaleSampler, match=r"a weight push did not reach it; or the policy's dropout"):
        check_sampler_sync(gap, 1e-3, step=2, dropout=dropout_settings(tiny))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))
    assert dropout_settings(plain) == ("nn.Dropout(p=0.2)",)


ONE_PROCESS = ParallelState(0, 1, torch.device("cpu"), "none")


@pytest.mark.parametrize(
    "preset, reason",
    [
        ("grpo", None),
        ("gspo", None),
        ("tr_grpo", "regularizer 'tr_grpo'"),
        ("lambda_grpo", "learned sequence weights"),
        ("gtpo", "reads π_old's entropy"),
        ("xrpo", "reads π_old's mean_logp"),
        ("amir_grpo", "AMIR-GRPO's preference term"),
    ],
)
def test_which_presets_keep_the_pi_old_pass(preset, reason):
    config = apply_preset(vllm_demo("unused", old_logprobs="auto"), preset, paper_settings=False)
    components = PresetComponents(config, AdditionTask(), ONE_PROCESS)
    reasons = pass_reasons(config, components)
    assert old_logp_source(config, components) == ("update" if reason is None else "pass")
    assert (reason is None and not reasons) or any(reason in r for r in reasons), reasons
    if reason is not None:
        with pytest.raises(ValueError, match=r"^old_logprobs 'sampler' \(bypass mode\) cannot serve: "):
            old_logp_source(dataclasses.replace(config, old_logprobs="sampler"), components)


def test_the_progress_line_and_the_summary_show_the_phase_times(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=2, progress=True, progress_every=1, progress_seconds=0)
    for step in (1, 2):
        logger.log(step, {"reward": 0.5, **{f"time/{phase}": 0.25 * step for phase in PHASES}})
    table = logger.close(plot=False)
    lines = capsys.readouterr().out.splitlines()
    assert "per step: generation 0.25 s, scoring 0.25 s, old logp pass 0.25 s" in lines[0]
    assert "per step: generation 0.375 s" in lines[1]  # the mean over the steps so far
    assert "per step: generation 0.375 s, scoring 0.375 s, old logp pass 0.375 s, reference pass 0.375 s" in table


def test_the_flags_and_the_yaml_keys(tmp_path):
    flags = ["--old-logprobs", "sampler", "--sampler-sync", "warn", "--sampler-sync-tolerance", "0.01"]
    config = parse_args(flags)
    assert (config.old_logprobs, config.sampler_sync, config.sampler_sync_tolerance) == ("sampler", "warn", 0.01)
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("old_logprobs: pass\nsampler_sync: 'off'\n")
    from_yaml = parse_args(["--config", str(yaml_file)])
    assert (from_yaml.old_logprobs, from_yaml.sampler_sync, from_yaml.sampler_sync_tolerance) == ("pass", "off", None)
    for bad, message in (
        (["--sampler-sync", "loud"], "sampler_sync must be one of"),
        (["--old-logprobs", "twice"], "old_logprobs must be one of"),
        (["--sampler-sync-tolerance", "0"], "sampler_sync_tolerance must be > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_args(bad)

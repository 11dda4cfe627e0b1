"""Paper presets: every shipped YAML loads, validates, round-trips and runs one loss step on a tiny random batch."""

import dataclasses
import inspect
import subprocess
import sys

import pytest
import torch
import yaml

import grpo_kernels as gk
from grpo_kernels import presets
from grpo_kernels.regularizers import daro_bin_losses
from grpo_kernels.sampling import daro_buckets

SEED_TABLE = (  # the 22 variants of the composer table (spec §1-§22)
    "grpo", "krpo", "gapo", "dr_grpo", "dra_grpo", "dapo", "daro", "lambda_grpo", "gdpo", "grpo_lead", "ms_grpo",
    "p_grpo", "pvpo", "rank_grpo", "unlikeliness", "spo", "stratified_grpo", "tic_grpo", "tr_grpo", "xrpo",
    "amir_grpo", "info_grpo",
)  # fmt: skip
ADDITIONAL = ("gspo", "cispo", "sapo", "gpg", "gtpo", "grpo_s", "rloo", "reinforce_pp")  # spec §23
MATRIX_ADVANTAGES = ("gdpo",)  # estimators that take the reward matrix [B, K], one column per preset reward
B, T, V = 4, 5, 17  # 4 sequences in 2 groups of 2


def test_available_is_the_thirty_papers():
    assert len(SEED_TABLE) == 22
    assert set(presets.available()) == {*SEED_TABLE, *ADDITIONAL}


@pytest.mark.parametrize("name", presets.available())
def test_preset_loads(name):
    preset = presets.load(name)
    assert isinstance(preset, presets.Preset) and isinstance(preset.loss, gk.LossOptions)
    assert preset.paper.title and preset.paper.id.split(":")[0] in ("arXiv", "OpenReview")
    assert preset.rewards and all(r.weight is not None for r in preset.rewards)
    assert presets.from_dict(preset.to_dict()) == preset
    assert presets.from_dict(yaml.safe_load(yaml.safe_dump(preset.to_dict(), allow_unicode=True))) == preset


def test_rewards_named_in_presets_exist():
    named = {r.name for name in presets.available() for r in presets.load(name).rewards}
    assert named <= set(gk.REWARDS.names())


# ------------------------------------------------------------------------------------------ one loss step
def _inputs(obj, kwargs: dict, context: dict) -> dict:
    """The preset's hyperparameters plus, from `context`, every other parameter the signature names."""
    params = inspect.signature(obj).parameters
    args = dict(kwargs)
    for name, param in params.items():
        if name in args or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in context:
            args[name] = context[name]
        elif param.default is param.empty:
            raise KeyError(f"the test context has no input {name!r} for {obj}")
    return args


def _call(obj, kwargs: dict, context: dict, modules: list):
    """Call a registered function, or build a registered class (constructor inputs from the context) and call it."""
    if inspect.isclass(obj):
        obj = obj(**_inputs(obj, kwargs, context))
        modules.append(obj)
        fn = obj.forward if isinstance(obj, torch.nn.Module) else obj.__call__
        return fn(**_inputs(fn, {}, context))
    return obj(**_inputs(obj, kwargs, context))


def _batch(preset: presets.Preset) -> dict:
    """A tiny random batch and every per-step input a component may ask for."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = mask[3, 4:] = False
    group_ids = torch.tensor([0, 0, 1, 1])
    correct = torch.tensor([True, True, False, True])  # group 0 all correct: GTPO's O+ has two members
    columns = torch.stack([correct.float(), torch.tensor([1.0, 0.0, 1.0, 1.0])], dim=-1)  # [B, 2] 0/1 rewards
    columns = columns[:, torch.arange(len(preset.rewards)) % 2]  # [B, K] one column per preset reward
    weights = torch.tensor([r.weight for r in preset.rewards])  # [K]
    logp, entropy = gk.token_logprobs(logits, targets, mask=mask, with_entropy=True, backend="torch")  # [B, T]
    old_logp = torch.where(mask, logp + 0.1 * torch.randn(B, T, generator=g), 0.0)  # [B, T]
    ref_logp = torch.where(mask, logp + 0.1 * torch.randn(B, T, generator=g), 0.0)  # [B, T]
    lengths = mask.sum(-1).float()  # [B]
    matrix = preset.advantage.name in MATRIX_ADVANTAGES
    return {
        "logits": logits,
        "targets": targets,
        "mask": mask,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        "group_ids": group_ids,
        "rewards": columns if matrix else columns @ weights,  # [B, K] or [B]
        "correct": correct,
        "correctness": correct,
        "ref_correct": correct,
        "lengths": lengths,
        "entropy": entropy,
        "mean_logp": (old_logp * mask).sum(-1) / lengths,  # [B]
        "reference_value": torch.tensor([0.5, 0.5, 0.25, 0.25]),
        "strata": torch.tensor([0, 1, 1, 1]),
        "augmented": torch.tensor([False, True, False, True]),
        "generator": torch.Generator().manual_seed(1),
        "budget": 2,
    }


@pytest.mark.parametrize("name", presets.available())
def test_preset_runs_one_loss_step(name):
    preset = presets.load(name)
    batch = _batch(preset)
    logits = batch["logits"].clone().requires_grad_()
    logp = gk.token_logprobs(logits, batch["targets"], mask=batch["mask"], inplace=False, backend="torch")  # [B, T]
    _, entropy = gk.token_logprobs(
        logits, batch["targets"], mask=batch["mask"], with_entropy=True, inplace=False, backend="torch"
    )  # [B, T] differentiable, for the regularizers
    modules: list = []
    advantages = _call(gk.ADVANTAGES.get(preset.advantage.name), preset.advantage.kwargs, batch, modules)
    assert advantages.shape in ((B,), (B, T)) and torch.isfinite(advantages).all()
    if preset.sampling is not None:
        sampler_batch = {**batch, "rewards": batch["correct"].float()}
        _call(gk.SAMPLERS.get(preset.sampling.name), preset.sampling.kwargs, sampler_batch, modules)

    # regularizers: [B, T] -> token_weights, [B] -> sequence_weights, a scalar -> added to the loss; those that need
    # the per-sequence losses (DARO's per-bin losses) run after the loss
    bins = daro_buckets(batch["correct"], batch["group_ids"])
    context = {
        **batch,
        "logp": logp,
        "entropy": entropy,
        "logp_sum": (logp * batch["mask"]).sum(-1),
        "ref_logp_sum": (batch["ref_logp"] * batch["mask"]).sum(-1),
        "num_bins": bins.num_bins,
    }
    token_weights = sequence_weights = None
    extra, later = [], []
    for reg in preset.regularizers:
        try:
            out = _call(gk.REGULARIZERS.get(reg.name), reg.kwargs, context, modules)
        except KeyError:
            later.append(reg)
            continue
        if out.shape == (B, T):
            token_weights = out
        elif out.shape == (B,):
            sequence_weights = out
        else:
            extra.append(out)
    output, sequence_losses = gk.grpo_loss(
        logits,
        batch["targets"],
        advantages,
        batch["old_logp"],
        batch["ref_logp"],
        batch["mask"],
        token_weights=token_weights,
        sequence_weights=sequence_weights,
        return_sequence_losses=True,
        inplace=False,
        backend="torch",
        options=preset.loss,
    )
    bin_losses, present = daro_bin_losses(sequence_losses, batch["lengths"], bins.bins, bins.num_bins)
    context.update(bin_losses=bin_losses, present=present)
    extra += [_call(gk.REGULARIZERS.get(reg.name), reg.kwargs, context, modules) for reg in later]
    loss = output.loss + sum(extra)
    loss.backward()
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    for module in modules:
        for param in getattr(module, "parameters", list)():
            assert param.grad is None or torch.isfinite(param.grad).all()


# ------------------------------------------------------------------------------------------------- errors
def _dapo(**changes) -> dict:
    data = presets.load("dapo").to_dict()
    data.update(changes)
    return data


def test_unknown_component_lists_the_valid_choices():
    with pytest.raises(ValueError, match=r"advantage: unknown advantage estimator 'kalman'.*'krpo'"):
        presets.from_dict(_dapo(advantage={"name": "kalman"}))
    with pytest.raises(ValueError, match=r"rewards\[0\]: unknown reward 'binary'.*'math_answer'"):
        presets.from_dict(_dapo(rewards=[{"name": "binary"}]))
    with pytest.raises(ValueError, match=r"sampling: unknown sampler 'dynamic'.*'dapo_dynamic'"):
        presets.from_dict(_dapo(sampling={"name": "dynamic"}))
    with pytest.raises(ValueError, match=r"regularizers\[0\]: unknown regularizer 'kl'.*'amir'"):
        presets.from_dict(_dapo(regularizers=[{"name": "kl"}]))


def test_unknown_hyperparameter_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown hyperparameter\(s\) \['Q'\].*'krpo'.*'meas_var'.*'process_var'"):
        presets.from_dict(_dapo(advantage={"name": "krpo", "Q": 1.0e-5}))
    # a per-step input is not preset data
    with pytest.raises(TypeError, match=r"\['answers'\].*valid: \['timeout_seconds'\]"):
        presets.from_dict(_dapo(rewards=[{"name": "math_answer", "answers": ["1"]}]))


@pytest.mark.parametrize(
    "advantage, message",
    [
        ({"name": "krpo", "process_var": "small"}, r"advantage.process_var must be a float, got str 'small'"),
        ({"name": "krpo", "process_var": "1e-5"}, r"got str '1e-5' \(YAML reads a float without a dot"),
        ({"name": "ms_grpo", "num_scales": 2.5}, r"advantage.num_scales must be an int, got float 2.5"),
        ({"name": "grpo", "eps": True}, r"advantage.eps must be a float, got bool True"),
        ({"name": "rank_grpo", "scale_rewards": 1}, r"advantage.scale_rewards must be a bool, got int 1"),
        ({"name": "gdpo", "weights": 1.0}, r"advantage.weights must be Sequence\[float\] or Tensor or None"),
    ],
)
def test_wrong_type_names_key_expected_and_received(advantage, message):
    with pytest.raises(TypeError, match=message):
        presets.from_dict(_dapo(advantage=advantage))


def test_int_is_a_float_and_lists_fit_sequences():
    preset = presets.from_dict(_dapo(advantage={"name": "gdpo", "weights": [1, 2], "eps": 0}))
    assert preset.advantage.kwargs == {"weights": [1, 2], "eps": 0}


def test_loss_options_are_checked():
    with pytest.raises(TypeError, match=r"loss: unknown loss option\(s\) \['eps'\].*'epsilon'"):
        presets.from_dict(_dapo(loss={"loss_type": "dapo", "eps": 0.2}))
    with pytest.raises(TypeError, match=r"loss.epsilon_high must be a float or None, got str '4e-4'"):
        presets.from_dict(_dapo(loss={"loss_type": "dapo", "epsilon_high": "4e-4"}))
    with pytest.raises(ValueError, match=r"needs max_completion_length > 0"):
        presets.from_dict(_dapo(loss={"loss_type": "dr_grpo"}))
    with pytest.raises(ValueError, match=r"loss_type must be one of"):
        presets.from_dict(_dapo(loss={"loss_type": "ppo"}))
    with pytest.raises(ValueError, match=r"loss.loss_type is required"):
        presets.from_dict(_dapo(loss={"beta": 0.0}))


def test_top_level_keys_are_checked():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['clip'\]; valid keys are \['name', 'paper'"):
        presets.from_dict(_dapo(clip=0.2))
    data = _dapo()
    del data["advantage"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['advantage'\]"):
        presets.from_dict(data)
    with pytest.raises(TypeError, match=r"rewards must be a non-empty list"):
        presets.from_dict(_dapo(rewards=[]))


def test_paper_ids_are_checked():
    with pytest.raises(TypeError, match=r"paper.arxiv must be a str or None, got float .*quote arXiv ids"):
        presets.from_dict(_dapo(paper={"title": "DAPO", "arxiv": 2503.14476}))
    with pytest.raises(ValueError, match=r"needs an 'arxiv' id, or an 'openreview'"):
        presets.from_dict(_dapo(paper={"title": "DAPO"}))


def test_a_reward_that_reshapes_rewards_cannot_come_first():
    with pytest.raises(ValueError, match=r"'unlikeliness' reshapes the rewards listed before it"):
        presets.from_dict(_dapo(rewards=[{"name": "unlikeliness"}]))


def test_load_by_path_and_unknown_name(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_dapo(name="mine"), allow_unicode=True), encoding="utf-8")
    assert presets.load(path).name == "mine"
    assert presets.load(str(path)) == presets.load(path)
    with pytest.raises(ValueError, match=r"unknown preset 'dappo'.*'dapo'"):
        presets.load("dappo")


def test_import_reads_no_preset():
    code = "import sys, grpo_kernels; assert 'grpo_kernels.presets' not in sys.modules and 'yaml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_preset_goes_in_as_options():
    """`options=preset`, `options=preset.loss` and `GRPOLoss(options=...)` all give the preset's loss; names are
    case-insensitive (`load("DAPO")`, the preset's own display name)."""
    preset = presets.load("DAPO")
    assert preset == presets.load("dapo")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    # old log-probs far below the new ones: ratios above 1.28, so DAPO's clip-higher (0.28) differs from 0.2
    args = (torch.randint(0, 11, (2, 3), generator=g), torch.tensor([1.0, 0.5]), torch.full((2, 3), -6.0))
    losses = [
        gk.grpo_loss(logits, *args, inplace=False, options=preset).loss,
        gk.grpo_loss(logits, *args, inplace=False, options=preset.loss).loss,
        gk.GRPOLoss(options=preset, inplace=False)(logits, *args).loss,
        gk.grpo_loss(logits, *args, inplace=False, **dataclasses.asdict(preset.loss)).loss,
    ]
    assert all(torch.equal(loss, losses[0]) for loss in losses)
    assert not torch.equal(losses[0], gk.grpo_loss(logits, *args, inplace=False, loss_type="grpo").loss)
    with pytest.raises(TypeError, match="not both"):
        gk.grpo_loss(logits, *args, options=preset, beta=0.1)
    with pytest.raises(TypeError, match="options must be a LossOptions or a preset"):
        gk.GRPOLoss(options={"beta": 0.1})

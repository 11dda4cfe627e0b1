"""A preset's training settings (G, lr, temperature, μ, generation budget) reach the trainer, flags override them,
config.yaml records each value with its source, DAPO's overlong lengths scale to the budget, and CISPO's trap warns."""

import dataclasses
import importlib
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from grpo_kernels import options, presets
from grpo_kernels.options import CISPOCapWarning, LossOptions
from grpo_kernels.trainer.components import PresetComponents
from grpo_kernels.trainer.config import TRAINING_SETTINGS, TrainConfig, apply_preset, parse_args
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.tasks import AdditionTask
from grpo_kernels.trainer.train import GRPOTrainer
from tests.test_samplers_distributed import ScriptedSource

train_module = importlib.import_module("grpo_kernels.trainer.train")  # `trainer.train` is also a function
QUIET = ["--no-progress", "--no-plot", "--eval-every", "0", "--checkpoint-every", "1", "--prompts-per-step", "2"]
PAPER = {"num_generations": 3, "learning_rate": 0.02, "temperature": 0.5, "num_iterations": 2}


def preset_file(tmp_path: Path, **training) -> str:
    """A GRPO preset YAML with these training settings (the rest "not given")."""
    data = {
        "name": "test",
        "paper": {"title": "test", "arxiv": "2402.03300"},
        "loss": {"loss_type": "grpo"},
        "advantage": {"name": "grpo"},
        "rewards": [{"name": "math_answer"}],
        "training": {key: training.get(key, "not given") for key in TRAINING_SETTINGS},
    }
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def test_every_shipped_preset_states_each_setting_or_not_given():
    for name in presets.available():
        path = Path(presets.__file__).parent / presets.PRESET_DIR / f"{name}.yaml"
        training = yaml.safe_load(path.read_text(encoding="utf-8"))["training"]
        assert list(training) == list(TRAINING_SETTINGS), name
    assert presets.load("grpo").training == presets.Training(64, 1e-6, None, 1, 1024)  # DeepSeekMath §4.2
    unlikely = presets.load("unlikeliness").training
    assert (unlikely.num_generations, unlikely.num_iterations) == (32, 2)
    assert (
        presets.load("grpo_lead").training.num_generations == 8 and presets.load("krpo").training.num_generations == 12
    )


@pytest.mark.parametrize(
    "training, error, message",
    [
        ({"batch": 4}, ValueError, r"training: unknown key\(s\) \['batch'\]"),
        ({"num_generations": 1}, ValueError, "training.num_generations must be >= 2 or 'not given'"),
        ({"learning_rate": 0}, ValueError, "training.learning_rate must be > 0.0"),
        ({"num_iterations": 1.5}, TypeError, "training.num_iterations must be an int or a str, got float"),
        ({"temperature": "hot"}, ValueError, "training.temperature must be > 0.0 or 'not given', got 'hot'"),
    ],
)
def test_training_settings_are_checked(training, error, message):
    data = presets.load("grpo").to_dict()
    with pytest.raises(error, match=message):
        presets.from_dict({**data, "training": training})


def test_settings_reach_the_trainer_and_flags_override_them(tmp_path, monkeypatch):
    config = parse_args(
        ["--preset", preset_file(tmp_path, **PAPER), "--paper-settings", "--output-dir", str(tmp_path / "run"), *QUIET]
    )
    assert [config.num_generations, config.learning_rate, config.loss.temperature, config.num_iterations] == list(
        PAPER.values()
    )
    seen = []

    def recording(policy, optimizer, batch, *, options, num_iterations, **kwargs):
        seen.append((len(batch.input_ids), num_iterations, optimizer.param_groups[0]["lr"], options.temperature))
        return inner_updates(policy, optimizer, batch, options=options, num_iterations=num_iterations, **kwargs)

    inner_updates = train_module.inner_updates
    monkeypatch.setattr(train_module, "inner_updates", recording)
    trainer = GRPOTrainer(dataclasses.replace(config, steps=1), task=AdditionTask())
    assert trainer.rollout.temperature == 0.5
    trainer.train()
    assert seen == [(2 * 3, 2, 0.02, 0.5)]  # G = 3 rows per prompt, μ = 2, the preset's lr and temperature
    flags = ["--num-generations", "4", "--learning-rate", "0.1", "--temperature", "1.5", "--num-iterations", "1"]
    config = parse_args(["--preset", preset_file(tmp_path, **PAPER), "--paper-settings", *flags])
    assert [config.num_generations, config.learning_rate, config.loss.temperature, config.num_iterations] == [
        4,
        0.1,
        1.5,
        1,
    ]
    assert config.sources == dict.fromkeys(PAPER, "flag")


def test_config_yaml_records_each_value_and_its_source_and_resume_keeps_them(tmp_path):
    out = str(tmp_path / "run")
    preset = preset_file(tmp_path, num_generations=3, temperature=0.5, num_iterations=1, max_completion_length=64)
    GRPOTrainer(
        parse_args(
            [
                "--preset",
                preset,
                "--paper-settings",
                "--output-dir",
                out,
                "--steps",
                "1",
                "--learning-rate",
                "0.01",
                *QUIET,
            ]
        ),
        task=AdditionTask(),
    ).train()
    saved = yaml.safe_load((Path(out) / "config.yaml").read_text(encoding="utf-8"))
    assert (saved["num_generations"], saved["learning_rate"], saved["loss"]["temperature"]) == (3, 0.01, 0.5)
    assert saved["max_completion_length"] == 3  # the paper's 64 capped at the addition task's budget
    assert saved["sources"] == {
        "num_generations": "preset",
        "learning_rate": "flag",
        "temperature": "preset",
        "num_iterations": "preset",
        "max_completion_length": "task budget (3 tokens), below the paper's 64",
    }
    resumed = parse_args(["--output-dir", out, "--resume", "--steps", "2", *QUIET])
    assert resumed.learning_rate == 0.01 and resumed.sources == saved["sources"]
    history = GRPOTrainer(resumed, task=AdditionTask()).train()
    assert [m["step"] for m in history] == [1, 2]
    assert yaml.safe_load((Path(out) / "config.yaml").read_text(encoding="utf-8"))["sources"] == saved["sources"]
    unset = dataclasses.replace(apply_preset(TrainConfig(), preset), output_dir=str(tmp_path / "b"), steps=1)
    trainer = GRPOTrainer(dataclasses.replace(unset, progress=False, plot=False, eval_every=0), task=AdditionTask())
    assert trainer.config.sources["learning_rate"] == "default 0.001 (the paper gives none)"


def test_krpo_gets_its_papers_group_size(tmp_path, monkeypatch):
    """KRPO's advantage scale grows with the sample's place in its group (√P_j ≈ 0.1/√j): it runs on G = 12."""
    config = apply_preset(TrainConfig(prompts_per_step=1, steps=1, eval_every=0, checkpoint_every=0), "krpo")
    trainer = GRPOTrainer(
        dataclasses.replace(config, output_dir=str(tmp_path), progress=False, plot=False), task=AdditionTask()
    )
    sizes = []
    estimator = trainer.advantage_fn

    def recording(rewards, group_ids, **kwargs):
        sizes.append(torch.bincount(group_ids).tolist())
        return estimator(rewards, group_ids, **kwargs)

    monkeypatch.setattr(trainer, "advantage_fn", recording)
    trainer.train()
    assert trainer.config.num_generations == 12 and sizes == [[12]]


def test_dapo_overlong_lengths_scale_to_the_generation_budget():
    dapo = presets.load("dapo")  # L_max = 20480 of a 20480-token budget, L_cache = 4096 (0.2 of it)
    overlong = {r.name: r.kwargs for r in presets.rewards_for_budget(dapo, 3)}["dapo_overlong"]
    assert overlong == {"max_completion_len": 3, "soft_punish_cache": 1}  # length 3 gets −1, length 2 gets 0
    overlong = {r.name: r.kwargs for r in presets.rewards_for_budget(dapo, 256)}["dapo_overlong"]
    assert overlong == {"max_completion_len": 256, "soft_punish_cache": 51}
    assert presets.rewards_for_budget(dapo, None) == dapo.rewards
    config = dataclasses.replace(apply_preset(TrainConfig(), "dapo"), max_completion_length=3)  # the trainer's
    parts = PresetComponents(config, AdditionTask(), ParallelState(0, 1, torch.device("cpu"), "none"))
    round = ScriptedSource(None).generate(ScriptedSource(None).draw(), 2)  # lengths 1 to 4
    _, terms = parts.rewards(round)  # [B, 2]: the verifier, the overlong penalty
    lengths = round.batch.completion_mask.sum(1).tolist()
    assert terms[:, 1].tolist() == [0.0 if n <= 2 else -1.0 for n in lengths] and 3 in lengths  # it fires


def test_cispo_below_one_warns_once_and_names_the_papers_value(monkeypatch):
    monkeypatch.setattr(options, "_warned", set())
    with pytest.warns(CISPOCapWarning, match=r"epsilon_high = 5.0 \(ScaleRL's, arXiv:2510.13786"):
        LossOptions(loss_type="cispo")  # TRL's default: every weight capped at 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("error", CISPOCapWarning)
        LossOptions(loss_type="cispo", epsilon_high=0.5)  # once per process
    monkeypatch.setattr(options, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", CISPOCapWarning)
        LossOptions(loss_type="cispo", epsilon_high=5.0)
        LossOptions(loss_type="cispo", epsilon_high=0.28, cispo_two_sided=True)  # a width: the cap is 1.28
        presets.load("cispo")  # keeps its value
    assert LossOptions().epsilon_high is None  # TRL's default and semantics unchanged


def test_unlikeliness_discounts_the_verdict_not_the_shaped_reward():
    """The rank penalty r·(1 − β_rank·rank/G) acts on the 0/1 verdict (the paper's reward): a wrong completion
    scores 0 whatever partial credit the task's shaped reward gave it."""
    source = ScriptedSource(None)
    round = source.generate(source.draw(), 2)  # verdicts (F, F), (T, F), (T, T), (F, T); shaped rewards all > 0
    parts = PresetComponents(
        apply_preset(TrainConfig(), "unlikeliness"), AdditionTask(), ParallelState(0, 1, torch.device("cpu"), "none")
    )
    rewards, _ = parts.rewards(round)
    # equal sampling log-probs: ranks 0, 1 in batch order within each group; β_rank = 0.25, G = 2
    assert (round.scores.rewards > 0).all()
    assert rewards.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0, 0.875, 0.0, 0.875]


def test_dr_grpo_constant_follows_the_run_budget_unless_set_apart():
    from grpo_kernels.trainer.config import loss_options
    from grpo_kernels.trainer.settings import resolve_settings

    config = resolve_settings(parse_args(["--preset", "dr_grpo"]), task_budget=3)
    assert config.max_completion_length == 3 and loss_options(config).max_completion_length == 3  # the recipe's 3000
    own = dataclasses.replace(config, loss=dataclasses.replace(config.loss, max_completion_length=7))
    assert loss_options(own).max_completion_length == 7  # a constant other than the paper's budget is kept

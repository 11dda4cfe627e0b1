"""Hostile YAML and huge values: an error shows a user's value in at most ~200 characters (`shown`), config files,
presets and run configs refuse YAML anchors and aliases (a few hundred bytes of nested aliases stand for billions
of items), and every parse error of a config, preset or JSONL file is one line naming the file, in process."""

import dataclasses
import json

import pytest

from grpo_kernels import presets
from grpo_kernels.evaluate import main as evaluate_main
from grpo_kernels.shown import MAX_SHOWN, shown
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.__main__ import main as train_main
from grpo_kernels.trainer.cli import run as run_command
from grpo_kernels.trainer.config import check_config
from grpo_kernels.trainer.tasks.jsonl import read_jsonl

# 9 levels of 9 aliases: 9**9 items once expanded
ALIAS_BOMB = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


def one_error_line(capsys, command, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        command(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_shown_bounds_any_value():
    nested = [1] * 9
    for _ in range(9):
        nested = [nested] * 9  # shared, as YAML aliases are: 9**10 items once expanded
    for value in (nested, "x" * 10**7, {str(i): i for i in range(10**5)}, 10**5000):
        assert len(shown(value)) <= MAX_SHOWN
    assert shown("grpo") == "'grpo'"


def test_an_alias_bomb_in_a_config_is_refused_at_once(tmp_path, capsys):
    config = tmp_path / "bomb.yaml"
    config.write_text(ALIAS_BOMB.replace("a: &a", "seed: 0\na: &a"), encoding="utf-8")
    err = one_error_line(capsys, train_main, ["--config", str(config)])
    assert f"{config}: not valid YAML (anchors and aliases" in err


def test_an_alias_in_a_preset_is_refused_naming_the_file(tmp_path):
    preset = tmp_path / "p.yaml"
    data = presets.load("grpo").to_dict()
    text = json.dumps(data).replace('"loss": {', '"loss": &l {', 1)  # JSON is YAML; one anchor
    preset.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.yaml'?: not valid YAML \(anchors and aliases"):
        presets.load(preset)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: [", "not valid YAML"),
        ("name: !!python/object/apply:os.system [echo]", "could not determine a constructor"),
        ("[" * 20000, "not valid YAML"),
        ("- a list", "must be a mapping"),
    ],
)
def test_a_malformed_or_tagged_preset_is_one_value_error(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises((ValueError, TypeError), match=message) as info:
        presets.load(path)
    assert "bad.yaml" in str(info.value) and "\n" not in str(info.value)


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    config = tmp_path / "latin1.yaml"
    config.write_bytes(b"seed: \xff\n")
    assert f"{config}: not UTF-8" in one_error_line(capsys, train_main, ["--config", str(config)])


def test_a_tagged_advantage_kwargs_flag_is_one_line(capsys):
    err = one_error_line(capsys, train_main, ["--advantage-kwargs", "!!python/object/apply:os.system [echo hi]"])
    assert "--advantage-kwargs" in err


def test_a_huge_value_is_shown_short(tmp_path, capsys):
    config = tmp_path / "long.yaml"
    config.write_text(f"seed: '{'9' * 100_000}'\n", encoding="utf-8")
    err = one_error_line(capsys, train_main, ["--config", str(config)])
    assert "seed must be an int" in err and len(err) < 400


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ALIAS_BOMB, "anchors and aliases"),
        ("dataset: !!python/name:os.system\n", "could not determine a constructor"),
        ("dataset: [\n", "not valid YAML"),
        ("- 1\n", "must be a mapping"),
        ("max_completion_length: .inf\n", "max_completion_length must be"),
    ],
)
def test_evaluate_refuses_a_bad_run_config_in_one_line(tmp_path, capsys, text, message):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(text, encoding="utf-8")
    err = one_error_line(capsys, lambda argv: run_command(evaluate_main, argv), ["--model", str(checkpoint)])
    assert "config.yaml" in err and message in err


def test_a_deeply_nested_jsonl_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + "[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.jsonl, line 2: not valid JSON"):
        read_jsonl(path)


def test_check_config_refuses_a_seed_torch_cannot_take():
    with pytest.raises(ValueError, match="seed must be <="):
        check_config(dataclasses.replace(TrainConfig(), seed=2**70))

"""The machinery that runs TRL's own GRPO tests on grpo-kernels' drop-in (`python -m tests.trl_suite`, CI's TRL-suite
step): its offline stand-ins load as the Hub repositories they replace, and its outcomes pair up per test. The runs
themselves are CI's step, not a test here."""

import importlib
import importlib.util

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from tests.trl_suite import plugin, selection, source, standins  # noqa: E402
from tests.trl_suite.run import Outcome, SuiteResult  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return standins.write_standins(tmp_path_factory.mktemp("trl_standins"))


@pytest.mark.parametrize("name", list(standins.MODELS))
def test_model_standins_load_by_their_hub_names(written, name):
    hub_cache, _ = written
    model_class = standins.MODELS[name][0]
    repo = f"{standins.ORGANIZATION}/{name}"
    auto = transformers.AutoConfig.from_pretrained(repo, cache_dir=hub_cache, local_files_only=True)
    model = model_class.from_pretrained(repo, cache_dir=hub_cache, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(repo, cache_dir=hub_cache, local_files_only=True)
    assert type(model) is model_class and auto.architectures == [model_class.__name__]
    assert model.config.vocab_size == len(tokenizer) and model.config.hidden_size == standins.TINY["hidden_size"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Flat é"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nFlat é<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("Flat é")["input_ids"]) == "Flat é"


def test_zen_standin_has_the_hub_configs_splits_and_columns(written):
    _, datasets_root = written
    load = plugin._local_datasets(datasets.load_dataset, datasets_root)
    standard = load("trl-internal-testing/zen", "standard_prompt_only")
    conversational = load("trl-internal-testing/zen", "conversational_prompt_only", split="test")
    assert {name: len(split) for name, split in standard.items()} == {"train": 17, "test": 2}
    assert standard["train"].column_names == ["prompt"] and standard["train"][0]["prompt"] == "Beautiful is better"
    assert conversational[0]["prompt"][0]["role"] == "user"
    assert next(iter(load("trl-internal-testing/zen", "standard_prompt_only", split="train", streaming=True)))


def test_outcomes_pair_per_test():
    stock = {"a": Outcome("passed"), "b": Outcome("failed", "boom"), "c": Outcome("skipped")}
    ours = {"a": Outcome("passed"), "b": Outcome("passed"), "d": Outcome("passed")}
    result = SuiteResult("here", {"stock": stock, "drop-in": ours}, fused_loss_calls=3)
    assert list(result.pairs()) == ["a", "b", "c", "d"]
    assert set(result.differing()) == {"b", "c", "d"} and result.differing()["c"][1].outcome == "not run"


def test_checkout_without_tests_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_KERNELS_TRL_SOURCE", str(tmp_path))
    with pytest.raises(source.Unavailable, match="has no tests/test_grpo_trainer.py"):
        source.fetch_tests()


def test_ci_selection_names_each_test_once():
    assert len(set(selection.CI)) == len(selection.CI)


def test_an_older_checkout_gets_the_names_it_imports_that_trl_lacks(tmp_path, monkeypatch, capsys):
    """An older TRL tree's testing_utils imported `is_joblib_available`, which TRL 1.16 lacks: every test errored."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "testing_utils.py").write_text(
        "from trl.import_utils import is_joblib_available, is_vllm_available\n", encoding="utf-8"
    )
    (tests / "test_grpo_trainer.py").write_text("from trl import GRPOConfig\n", encoding="utf-8")
    monkeypatch.setenv("GRPO_KERNELS_TRL_SOURCE", str(tmp_path))
    monkeypatch.setenv("GRPO_KERNELS_TRL_TESTS", str(tmp_path / "cache"))
    root, _ = source.fetch_tests()
    supplied = source.missing_names(root / source.PACKAGE)
    assert supplied == ["trl.import_utils.is_joblib_available"]
    import_utils = importlib.import_module("trl.import_utils")
    monkeypatch.setattr(import_utils, "is_joblib_available", None, raising=False)  # removed again after the test
    plugin._supply(supplied)
    assert import_utils.is_joblib_available() is (importlib.util.find_spec("joblib") is not None)
    (tests / "test_grpo_trainer.py").write_text("from trl import not_in_trl\n", encoding="utf-8")
    root, _ = source.fetch_tests()
    with pytest.raises(source.Unavailable, match="imports trl.not_in_trl, absent from the installed TRL"):
        source.missing_names(root / source.PACKAGE)

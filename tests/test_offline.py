"""Without the Hugging Face Hub (no network, or an offline variable set) a Hub dataset or model that is not cached
fails at once, saying how to use a local file or directory, instead of retrying for tens of seconds."""

import time

import pytest

from grpo_kernels.trainer import offline
from grpo_kernels.trainer.model import load_pretrained
from grpo_kernels.trainer.tasks.gsm8k import load_gsm8k


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    for name in (*offline.OFFLINE_VARIABLES, *offline.PROXY_VARIABLES, "HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_variables_fail_fast_with_the_local_alternative(no_cache, monkeypatch, variable):
    monkeypatch.setenv(variable, "1")
    start = time.perf_counter()
    with pytest.raises(
        ConnectionError,
        match=rf"dataset 'gsm8k' needs the Hugging Face Hub.*\({variable} is set\).*"
        r"--dataset path/to/file.jsonl",
    ):
        load_gsm8k()
    with pytest.raises(
        ConnectionError, match=r"model 'org/not-here' needs the Hugging Face Hub.*local model directory"
    ):
        load_pretrained("org/not-here")
    assert time.perf_counter() - start < 2.0


def test_an_unreachable_hub_fails_fast(no_cache, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=r"\(127.0.0.1 cannot be reached\)"):
        offline.require_hub("model 'x/y'", "x/y", "model", "give a local directory")
    assert time.perf_counter() - start < 2.0


def test_a_cached_copy_or_a_proxy_goes_to_the_libraries(no_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (no_cache / "hub" / "models--x--y").mkdir(parents=True)
    offline.require_hub("model 'x/y'", "x/y", "model", "")  # cached: the libraries load it offline
    (no_cache / "datasets" / "openai___gsm8k").mkdir(parents=True)
    assert offline.cached("openai/gsm8k", "dataset")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert offline.offline_reason() is None  # through a proxy: the libraries try


def test_the_commands_fail_in_one_line_before_loading_a_model(no_cache, monkeypatch, capsys, tmp_path):
    from grpo_kernels import evaluate
    from grpo_kernels.trainer import __main__ as train_command
    from grpo_kernels.trainer.cli import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    commands = [
        (train_command.main, ["--model", "org/not-here"], "model 'org/not-here' needs the Hugging Face Hub"),
        (train_command.main, ["--dataset", "gsm8k"], "dataset 'gsm8k' needs the Hugging Face Hub"),
        (lambda argv: run(evaluate.main, argv), ["--model", "runs/not-here"], "no directory 'runs/not-here' either"),
    ]
    for main, argv, message in commands:
        start = time.perf_counter()
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and time.perf_counter() - start < 2.0
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and message in line

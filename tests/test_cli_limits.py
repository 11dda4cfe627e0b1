"""The commands' answers to hostile sizes and files are one `error:` line, quickly: absurd sizes are refused against
the machine's memory before any allocation, a pickled weights file that could run code is refused in one line
(and never run), and a config with thousands of unknown keys names the first few and a count."""

import pytest
import torch
import yaml

from grpo_kernels import evaluate
from grpo_kernels.trainer import cli
from grpo_kernels.trainer.__main__ import main as train_main
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer


def one_error_line(command, argv, capsys) -> str:
    """The single line a command prints for a user error (exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        command(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--num-generations", str(10**9)], "--prompts-per-step, --num-generations"),
        (["--prompts-per-step", str(10**9)], "--prompts-per-step, --num-generations"),
        (["--hidden-size", str(2**20)], "--hidden-size, --num-layers"),
        (["--num-layers", str(10**6)], "--hidden-size, --num-layers"),
    ],
)
def test_absurd_sizes_are_refused_before_allocation(tmp_path, capsys, flags, names):
    err = one_error_line(train_main, ["--output-dir", str(tmp_path / "run"), "--steps", "1", *flags], capsys)
    assert f"error: {names}: " in err and "GiB of memory, more than this machine's" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_a_pickled_weights_file_is_refused_in_one_line(tmp_path, capsys):
    model_dir, marker = tmp_path / "model", tmp_path / "payload_ran"
    tokenizer = build_tokenizer("0123456789+=")
    model = build_tiny_llama(tokenizer, 8, 1, 2, 32)
    model.config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    torch.save({**model.state_dict(), "payload": _Payload(str(marker))}, model_dir / "pytorch_model.bin")
    err = one_error_line(lambda argv: cli.run(evaluate.main, argv), ["--model", str(model_dir)], capsys)
    assert "holds more than tensors and plain data" in err and "refused" in err
    assert not marker.exists()


@pytest.mark.parametrize("where", ["top", "loss"])
def test_many_unknown_config_keys_name_a_few_and_a_count(tmp_path, capsys, where):
    """The top-level keys used to be listed in full (a 10.9 MB line for a million), and every unknown loss option
    was matched against the valid names (68 s)."""
    config = tmp_path / "many.yaml"
    keys = {f"option_{i}": 1 for i in range(3000)}
    config.write_text(yaml.safe_dump(keys if where == "top" else {"loss": keys}), encoding="utf-8")
    err = one_error_line(train_main, ["--config", str(config)], capsys)
    unknown = err[: err.index("; valid ")]
    assert "(and 2995 more, 3000 in all)" in unknown and len(unknown) < 400, unknown

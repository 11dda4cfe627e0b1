"""The README's first way in (the TRL drop-in) runs on a CPU with the flags it documents, the Hub apart: its block
runs as written, with a tiny local model (and its tokenizer) in place of the Hub's model and a one-prompt dataset in
place of the Hub's. TRL's bf16 default alone fails on a CPU ("Your setup doesn't support bf16/gpu")."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
HUB_MODEL = '"Qwen/Qwen2.5-0.5B-Instruct"'


def readme_block() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    (block,) = [b for b in blocks if "integrations.trl import GRPOTrainer" in b]
    return block


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_way_in_1_runs_on_a_cpu_with_its_flags(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from trl_grpo import tiny_policy
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from grpo_kernels.trainer.model import build_tokenizer

    tokenizer = build_tokenizer("abcdefghijklmnopqrstuvwxyz ")
    model = tiny_policy(tokenizer, str(tmp_path / "model"))
    tokenizer.save_pretrained(model)
    block = readme_block()
    assert HUB_MODEL in block and 'load_dataset("trl-lib/tldr", split="train")' in block
    prompts = datasets.Dataset.from_dict({"prompt": ["abc"]})  # TRL: G = 8 of one prompt per step, 3 epochs
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: prompts)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    exec(compile(block.replace(HUB_MODEL, repr(model)), "README.md", "exec"), {"__name__": "__main__"})
    assert (tmp_path / "runs" / "trl").is_dir()

"""Offline stand-ins for the Hub repositories TRL's GRPO tests load: the `trl-internal-testing` tiny models (the same
architectures and sizes, built from configs, random weights, bfloat16 like theirs) and the `zen` dataset (the same
configs, splits and columns, prompts taken from the Zen of Python).

The models are written as a Hugging Face Hub cache, so that `from_pretrained("trl-internal-testing/...")` resolves
with `HF_HUB_OFFLINE=1`; the dataset as a local dataset directory (`datasets` does not read datasets from the Hub
cache offline), to which the suite's pytest plugin sends `load_dataset("trl-internal-testing/zen", ...)`.

The tokenizer is byte-level (256 byte tokens and ChatML's special tokens, no merges) with a ChatML chat template,
in place of each model's own large vocabulary; every model's vocabulary is its size.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ORGANIZATION = "trl-internal-testing"
SNAPSHOT = "0" * 40  # the commit every stand-in's `refs/main` names
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
TEST_FRACTION = 0.1  # the share of each zen config in its `test` split, the rest in `train`


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per byte, then ChatML's specials; pads on the left, ends with <|im_end|>."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(byte_chars))}
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _ids(tokenizer) -> dict[str, int]:
    return dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def _moe(**extra) -> dict:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **extra)


# repository name (after the organisation) -> (model class, config class, config fields beside TINY and the ids)
MODELS: dict[str, tuple[type, type, dict]] = {
    "tiny-Qwen2ForCausalLM-2.5": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "tiny-Qwen2ForSequenceClassification-2.5": (
        transformers.Qwen2ForSequenceClassification,
        transformers.Qwen2Config,
        dict(num_labels=1),
    ),
    "tiny-Qwen3ForCausalLM": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(head_dim=2)),
    "tiny-Qwen3ForSequenceClassification": (
        transformers.Qwen3ForSequenceClassification,
        transformers.Qwen3Config,
        dict(head_dim=2, num_labels=1),
    ),
    "tiny-Qwen3MoeForCausalLM": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, _moe(head_dim=2)),
    "tiny-GptOssForCausalLM": (
        transformers.GptOssForCausalLM,
        transformers.GptOssConfig,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "tiny-Cohere2ForCausalLM": (transformers.Cohere2ForCausalLM, transformers.Cohere2Config, {}),
    "tiny-LlamaForCausalLM-3.2": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "tiny-LlamaForSequenceClassification-3.2": (
        transformers.LlamaForSequenceClassification,
        transformers.LlamaConfig,
        dict(num_labels=1),
    ),
    "tiny-MistralForCausalLM-0.2": (transformers.MistralForCausalLM, transformers.MistralConfig, {}),
    "tiny-Gemma2ForCausalLM": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, dict(head_dim=2)),
}


def zen_lines() -> list[str]:
    """The Zen of Python's 19 aphorisms (CPython's `this` module prints them when first imported)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def zen_configs() -> dict[str, list[dict]]:
    """The zen configs the GRPO tests read, as rows: a prompt is an aphorism's first words (standard) or a user
    message asking to complete them (conversational)."""
    openings = [" ".join(line.split()[:3]) for line in zen_lines()]
    return {
        "standard_prompt_only": [{"prompt": opening} for opening in openings],
        "conversational_prompt_only": [
            {"prompt": [{"role": "user", "content": f"Complete: {opening}"}]} for opening in openings
        ],
    }


def write_standins(root: Path) -> tuple[Path, Path]:
    """Write every stand-in under `root`: (the Hub cache of the models, for `HF_HUB_CACHE`; the folder holding
    `<organisation>/zen`, the dataset directory)."""
    hub_cache, datasets_root = root / "hub", root / "datasets"
    tokenizer = build_tokenizer()
    for name, (model_class, config_class, fields) in MODELS.items():
        torch.manual_seed(0)
        model = model_class(config_class(**TINY, **_ids(tokenizer), **fields)).to(torch.bfloat16)
        repo = hub_cache / f"models--{ORGANIZATION}--{name}"
        snapshot = repo / "snapshots" / SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        _save_model(snapshot, model, tokenizer)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
    zen = datasets_root / ORGANIZATION / "zen"
    zen.mkdir(parents=True, exist_ok=True)
    _save_zen(zen)
    return hub_cache, datasets_root


def _save_model(target: Path, model: torch.nn.Module, tokenizer) -> None:
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    if model.can_generate():
        ids = _ids(tokenizer)
        generation = transformers.GenerationConfig(eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
        generation.save_pretrained(target)


def _save_zen(target: Path) -> None:
    """One parquet file per config and split, and the dataset card's `configs` that maps them."""
    import datasets

    card = ["---", "configs:"]
    for config, rows in zen_configs().items():
        split = datasets.Dataset.from_list(rows).train_test_split(test_size=TEST_FRACTION, shuffle=False)
        card += [f"- config_name: {config}", "  data_files:"]
        for name, part in split.items():
            path = f"{config}/{name}-00000-of-00001.parquet"
            (target / config).mkdir(exist_ok=True)
            part.to_parquet(str(target / path))
            card += [f"  - split: {name}", f"    path: {json.dumps(path)}"]
    (target / "README.md").write_text("\n".join([*card, "---", ""]))

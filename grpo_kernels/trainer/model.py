"""The policy and its tokenizer: a tiny Llama built from a config (no download), or any Hugging Face causal LM.

The demo's tokenizer is character-level, built with the `tokenizers` library from the task's alphabet and wrapped
in a `transformers` fast tokenizer (left padding, `<bos>` prepended), so `generate` and `policy_logprobs` see the
same ids a real tokenizer would give.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_kernels.integrations.attention import packing_support, set_attn_implementation
from grpo_kernels.shown import shown
from grpo_kernels.trainer.config.record import DEMO_MAX_LENGTH
from grpo_kernels.trainer.offline import require_model

TINY = "tiny"  # TrainConfig.model value that builds the tiny Llama instead of loading one
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` after the four special tokens; `<bos>` is prepended to every text."""
    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ValueError(f"alphabet must be non-empty characters without repeats, got {shown(alphabet)}")
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tokenizer.decoder = decoders.Fuse()  # no spaces between characters
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_tiny_llama(
    tokenizer, hidden_size: int, num_layers: int, num_heads: int, max_length: int, init_std: float = 0.02
) -> nn.Module:
    """A randomly initialised Llama (RMSNorm, RoPE, SwiGLU, tied embeddings) sized for a CPU demo."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=init_std,
    )
    return LlamaForCausalLM(config)


def load_policy(config, task):
    """(model, tokenizer): the tiny Llama when `config.model == "tiny"` (its context sized from the task's longest
    prompt and the budget, checked first against `DEMO_MAX_LENGTH`), else `from_pretrained(config.model)`."""
    if config.model == TINY:
        tokenizer = build_tokenizer(task.alphabet)
        check_lengths(tokenizer, task, config.max_completion_length, DEMO_MAX_LENGTH, "the tiny model's cap")
        max_length = task.max_prompt_length + config.max_completion_length
        model = build_tiny_llama(tokenizer, config.hidden_size, config.num_layers, config.num_heads, max_length)
        return model, tokenizer
    return load_pretrained(config.model)


def task_prompts(task) -> list:
    """Every prompt of `task` a run may use: both splits of a dataset, else the evaluation prompts (a generated task's
    training prompts are of the same form)."""
    return [*task.train, *task.test] if hasattr(task, "train") and hasattr(task, "test") else task.eval_prompts()


def check_lengths(tokenizer, prompts, budget: int, context: int | None, what: str) -> None:
    """Each prompt (a task's, or a list of `Prompt`s) in tokens plus the generation `budget` within `context` tokens;
    a ValueError with both numbers, naming the first prompt over it and where it was read. No check without a
    context."""
    if context is None:
        return
    if budget >= context:
        raise ValueError(f"max_completion_length ({budget}) leaves no room for a prompt in {what} ({context} tokens)")
    prompts = task_prompts(prompts) if not isinstance(prompts, list) else prompts
    lengths = [len(ids) for ids in tokenizer([p.text for p in prompts])["input_ids"]]
    for prompt, length in zip(prompts, lengths, strict=True):
        if length + budget > context:
            where = prompt.source or f"prompt {shown(prompt.text[:40])}"
            raise ValueError(
                f"{where}: prompt + generation budget = {length} + {budget} tokens, over {what} ({context} tokens); "
                "shorten the prompt or lower --max-completion-length"
            )


def model_context(model: nn.Module) -> int | None:
    """A loaded model's context in tokens (its config's `max_position_embeddings`), or None where it states none."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def load_pretrained(name: str):
    """(model, tokenizer) of a Hugging Face model directory or hub name, float32, left padding. A path that does not
    exist, or a name that is neither a directory nor loadable from the hub, is a ValueError naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, checkpoint = Path(name).expanduser(), "a trainer checkpoint is <run>/checkpoints/step_NNNNNN"
    hub_id = not name.startswith((".", "/", "~")) and name.count("/") <= 1  # "gpt2", "Qwen/Qwen2.5-0.5B"
    if not path.exists() and not hub_id:
        raise ValueError(f"model {shown(name)}: no such directory ({checkpoint})")
    if path.exists() and not (path / "config.json").is_file():
        raise ValueError(f"model {shown(name)}: not a model directory, it has no config.json ({checkpoint})")
    require_model(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    except OSError as error:  # not a model directory, not on the hub, offline
        reason = " ".join(str(error).split())[:300]
        raise ValueError(
            f"model {shown(name)}: not a model directory, and not loadable from the Hugging Face hub ({reason})"
        ) from error
    except pickle.UnpicklingError:  # transformers loads *.bin with torch.load(weights_only=True)
        raise ValueError(
            f"model {shown(name)}: its weights file (a pickled .bin) holds more than tensors and plain data, and "
            "unpickling it could run code, so it is refused; save the model as safetensors"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def apply_lora(model: nn.Module, r: int, alpha: int, target_modules: str) -> nn.Module:
    """`model` with LoRA adapters (peft) on `target_modules` ("all-linear", or a comma-separated list of module
    names); only the adapters train. The lm_head stays frozen and fused: its weight needs no gradient."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("--lora needs peft: pip install 'grpo-kernels[peft]'") from error
    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM"))


def configure_attention(model: nn.Module, config, max_length: int, announce: bool) -> bool:
    """Set the model's attention implementation (`config.attn_implementation`); whether the trainer's passes run
    padding-free: `config.padding_free` where the model supports packed sequences (`packing_support`), else padded,
    with one line (when `announce`) saying why. A `max_tokens_per_microbatch` below `max_length` (the longest
    prompt ‖ completion) is a ValueError: a sequence is never split."""
    budget = config.max_tokens_per_microbatch
    if budget is not None and budget < max_length:
        raise ValueError(
            f"max_tokens_per_microbatch ({budget}) must hold the longest sequence: prompt + completion = {max_length}"
        )
    name = set_attn_implementation(model, config.attn_implementation)
    if not config.padding_free:
        return False
    reason = packing_support(model)
    if reason is not None and announce:
        print(f"padding-free training is off, the passes run padded: {reason} (attention: {name})", flush=True)
    return reason is None

"""TRL's GRPOTrainer on grpo-kernels' fused lm_head + GRPO loss: the one-import switch, on a tiny model.

    python examples/trl_grpo.py                      # 4 steps of DAPO, well under a minute on a CPU
    python examples/trl_grpo.py --loss-type grpo --beta 0.04 --steps 8

Everything but the import of `GRPOTrainer` is plain TRL: `GRPOConfig`, a `datasets.Dataset` of prompts, a reward
function, `trainer.train()`. Nothing is downloaded: the policy is a 2-layer Qwen2 built from a config with a
character-level tokenizer, saved to a temporary directory (TRL loads the reference model from the policy's path).
The toy task: a completion earns one point per character equal to the prompt's last letter.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig

from grpo_kernels.integrations.trl import GRPOTrainer  # the switch: was `from trl import GRPOTrainer`
from grpo_kernels.trainer.model import build_tokenizer

ALPHABET = "abcdefgh"


def repeat_last_letter(prompts, completions, **kwargs) -> list[float]:
    """One point per completion character equal to the prompt's last letter."""
    pairs = zip(prompts, completions, strict=True)
    return [float(sum(ch == prompt[-1] for ch in completion)) for prompt, completion in pairs]


def tiny_policy(tokenizer, directory: str) -> str:
    """A randomly initialised 2-layer Qwen2 (hidden 64) saved under `directory`; returns the path."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--loss-type", default="dapo", help="any TRL loss_type: grpo, bnpo, dr_grpo, dapo, ...")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference model)")
    cli = parser.parse_args()

    tokenizer = build_tokenizer(ALPHABET)
    prompts = [ALPHABET[i : i + 3] for i in range(len(ALPHABET) - 2)]  # "abc", "bcd", ...
    with tempfile.TemporaryDirectory() as directory:
        args = GRPOConfig(
            output_dir=f"{directory}/out",
            loss_type=cli.loss_type,
            beta=cli.beta,
            epsilon_high=0.28,
            max_steps=cli.steps,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=12,
            learning_rate=5e-3,
            logging_steps=1,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            seed=0,
        )
        trainer = GRPOTrainer(
            tiny_policy(tokenizer, f"{directory}/policy"),
            reward_funcs=repeat_last_letter,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
        )
        trainer.train()
    for entry in trainer.state.log_history[:-1]:
        print(f"step {entry['step']}: reward {entry['reward']:.3f}, loss {entry['loss']:+.4f}")


if __name__ == "__main__":
    main()

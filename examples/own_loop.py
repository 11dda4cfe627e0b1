"""Your own GRPO loop in plain PyTorch around a Hugging Face causal LM, with grpo-kernels' fused lm_head + loss.

    python examples/own_loop.py          # about a minute on a CPU; prints the reward per step

The policy is a tiny Llama built from a config (nothing is downloaded) over the characters "0123456789+=". It learns
single-digit addition ("3+4=" -> "7", then end of sequence) from reward alone. Each step: sample G completions per
prompt, score them, form group-relative advantages, take the old policy's log-probs with
`fused_linear_token_logprobs`, then run μ updates with `fused_linear_grpo_loss`. Both take the final hidden states
and the lm_head weight, so the [tokens, vocabulary] logits are never stored.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpo_kernels as gk

CHARS = "0123456789+="
BOS, EOS, PAD = len(CHARS), len(CHARS) + 1, len(CHARS) + 2  # token ids after the characters'
PROMPTS = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]  # 55 problems, one-digit answers
STEPS = int(os.environ.get("GRPO_KERNELS_MAX_STEPS", 200))  # the variable shortens quick checks
PROMPTS_PER_STEP, G, MU, BUDGET = 16, 16, 2, 2  # prompts per step, group size, updates per batch, new tokens


def encode(a: int, b: int) -> list[int]:
    return [BOS] + [CHARS.index(c) for c in f"{a}+{b}="]


def reward(completion: list[int], answer: int) -> float:
    """0.6 for the right digit, 0.2 more the closer a digit is, 0.2 for ending right after it."""
    digit = completion[0]
    closeness = 1.0 - abs(digit - answer) / 9 if digit < 10 else 0.0
    return 0.6 * float(digit == answer) + 0.2 * closeness + 0.2 * float(completion[1] == EOS)


def completion_hidden(model: LlamaForCausalLM, sequences: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The final hidden states that predict each completion token: [B, T, H]."""
    hidden = model.model(input_ids=sequences).last_hidden_state  # [B, P + T, H]
    return hidden[:, prompt_length - 1 : -1]


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest
    config = LlamaConfig(
        vocab_size=PAD + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for step in range(STEPS):
        # 1. rollouts: G samples of each prompt (all prompts have 5 tokens: no padding needed)
        problems = [PROMPTS[i] for i in torch.randint(len(PROMPTS), (PROMPTS_PER_STEP,))]
        prompts = torch.tensor([encode(a, b) for a, b in problems]).repeat_interleave(G, 0)  # [B, P]
        with torch.no_grad():
            sequences = model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=BUDGET,
                pad_token_id=PAD,
            )  # fmt: skip  # [B, P + up to BUDGET]: rows that ended early are padded with PAD
        sequences = torch.nn.functional.pad(sequences, (0, prompts.shape[1] + BUDGET - sequences.shape[1]), value=PAD)
        targets = sequences[:, prompts.shape[1] :]  # [B, T] the completion tokens
        # a token counts up to and including the first EOS
        mask = torch.cumsum((targets == EOS).long(), 1) - (targets == EOS).long() == 0  # [B, T]
        # 2. rewards and group-relative advantages (z-score within each prompt's G samples)
        answers = [a + b for a, b in problems for _ in range(G)]
        rewards = torch.tensor([reward(c, y) for c, y in zip(targets.tolist(), answers, strict=True)])  # [B]
        grouped = rewards.view(-1, G)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)

        # 3. the sampling policy's log-probs, through the fused lm_head (no logits stored)
        with torch.no_grad():
            hidden = completion_hidden(model, sequences, prompts.shape[1])
            old_logp = gk.fused_linear_token_logprobs(hidden, model.lm_head.weight, targets, mask=mask)
        # 4. μ updates of the clipped GRPO objective (DAPO's token-level normalisation and clip-higher)
        for _ in range(MU):
            hidden = completion_hidden(model, sequences, prompts.shape[1])  # with gradient
            out = gk.fused_linear_grpo_loss(
                hidden, model.lm_head.weight, targets, advantages, old_logp, None, mask, loss_type="dapo",
                epsilon_high=0.28,
            )  # fmt: skip
            optimizer.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        seconds = time.perf_counter() - start
        print(f"step {step:3d}  reward {rewards.mean():.3f}  loss {out.loss:+.4f}  ({seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

"""Periodic evaluation: greedy completions of every prompt of the task, scored by the task's reward."""

from __future__ import annotations

import torch
from torch import nn

from grpo_kernels.trainer.rollout import completion_mask, decode_completions


@torch.no_grad()
def evaluate(model: nn.Module, tokenizer, task, max_completion_length: int) -> dict[str, float]:
    """`eval/reward` and `eval/<reward column>` (`eval/answer`: exact-answer accuracy) of greedy decoding."""
    model.eval()
    prompts = task.all_prompts()
    device = next(model.parameters()).device
    encoded = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True).to(device)
    sequences = model.generate(
        **encoded,
        do_sample=False,
        max_new_tokens=max_completion_length,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    completion_ids = sequences[:, encoded["input_ids"].shape[1] :]  # [B, T]
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # [B, T]
    texts, truncated = decode_completions(tokenizer, completion_ids, mask)
    scores = task.score(texts, [p.answer for p in prompts], truncated)
    metrics = scores.metrics()
    return {f"eval/{name.removeprefix('rewards/')}": metrics[name] for name in metrics if name != "reward_std"}

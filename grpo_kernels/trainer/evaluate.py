"""Evaluation: greedy completions of the task's held-out prompts, in batches, scored by the task's reward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from grpo_kernels.trainer.rollout import completion_mask, decode_completions, eos_token_ids

if TYPE_CHECKING:  # the tasks (and their reward libraries) are not needed to import this
    from grpo_kernels.trainer.tasks import Task

EVAL_BATCH_SIZE = 64  # prompts per `generate` call: bounds memory on large eval sets (GSM8K)


@torch.no_grad()
def greedy_completions(
    model: nn.Module, tokenizer, prompts: Sequence[str], max_completion_length: int, batch_size: int = EVAL_BATCH_SIZE
) -> tuple[list[str], Tensor]:
    """Greedy completions of `prompts` (without their `<eos>`) and `truncated` [B] (no `<eos>` within budget)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model.eval()
    device = next(model.parameters()).device
    eos = eos_token_ids(tokenizer, model)  # the rollouts' end-of-sequence set
    texts: list[str] = []
    truncated: list[Tensor] = []
    for start in range(0, len(prompts), batch_size):
        encoded = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True).to(device)
        sequences = model.generate(
            **encoded,
            do_sample=False,
            max_new_tokens=max_completion_length,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=list(eos),
        )
        completion_ids = sequences[:, encoded["input_ids"].shape[1] :]  # [b, T]
        mask = completion_mask(completion_ids, eos)  # [b, T]
        batch_texts, batch_truncated = decode_completions(tokenizer, completion_ids, mask, eos)
        texts += batch_texts
        truncated.append(batch_truncated.cpu())  # [b]
    return texts, torch.cat(truncated)  # [B]


def evaluate(
    model: nn.Module, tokenizer, task: Task, max_completion_length: int, batch_size: int = EVAL_BATCH_SIZE
) -> dict[str, float]:
    """`eval/reward` and `eval/<reward column>` (`eval/answer`: exact-answer accuracy) of greedy decoding on
    `task.eval_prompts()`."""
    prompts = task.eval_prompts()
    texts, truncated = greedy_completions(
        model, tokenizer, [p.text for p in prompts], max_completion_length, batch_size
    )
    metrics = task.score(texts, [p.answer for p in prompts], truncated).metrics()
    return {f"eval/{name.removeprefix('rewards/')}": metrics[name] for name in metrics if name != "reward_std"}

"""Info-GRPO's augmented rollouts and mutual-information term (spec §22; UNVERIFIED: the paper was not retrieved).

The spec's most defensible reading: each prompt q gets rollouts from π(·|q) and from π(·|q, z), z a perturbation of
the prompt, all in q's group, and the loss adds −λ·[α·H(τ|q) − H(τ|q, z)] (`info_grpo`), which raises I(τ; z).
Here z is an answer-preserving rewrite of the prompt that the task defines (`AUGMENTATIONS`): the operands of an
addition swapped (`"3+4="` -> `"4+3="`), the numbers of a Countdown problem listed in reverse. GSM8K and JSONL
prompts have none, so the preset is refused there.

`InfoRounds` is the sampler: G − ⌊G/2⌋ rollouts of each prompt and ⌊G/2⌋ of its augmented prompt, one group per
prompt (the verifier scores both against the prompt's answer); `augmented` [B] marks the second kind. `InfoPolicy` is
the `PolicyModule` whose forward adds the term, on the full-vocabulary token entropies *with gradient* of a forward of
the policy through the fused lm_head (`policy_logprobs(..., with_entropy=True)`; a second forward, as for AMIR).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from grpo_kernels.integrations.hf import policy_logprobs
from grpo_kernels.options import LossOptions
from grpo_kernels.regularizers import info_grpo
from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch
from grpo_kernels.trainer.samplers import Collected, Round, Source, concat
from grpo_kernels.trainer.tasks import AdditionTask, CountdownTask, Prompt, Task

_ADDITION = re.compile(r"(\d+)\+(\d+)=")
_COUNTDOWN = re.compile(r"Using ([\d ]+) reach (\d+):")


def swap_operands(prompt: Prompt) -> Prompt:
    """`"a+b="` -> `"b+a="`, the same answer."""
    match = _ADDITION.fullmatch(prompt.text)
    if match is None:
        raise ValueError(f"not an addition prompt: {prompt.text!r}")
    return Prompt(f"{match[2]}+{match[1]}=", prompt.answer)


def reverse_numbers(prompt: Prompt) -> Prompt:
    """A Countdown problem with its numbers listed in reverse, the same target and answer."""
    match = _COUNTDOWN.fullmatch(prompt.text)
    if match is None:
        raise ValueError(f"not a Countdown prompt: {prompt.text!r}")
    return Prompt(f"Using {' '.join(match[1].split()[::-1])} reach {match[2]}:", prompt.answer)


AUGMENTATIONS: dict[type, Callable[[Prompt], Prompt]] = {AdditionTask: swap_operands, CountdownTask: reverse_numbers}


def augmentation(task: Task) -> Callable[[Prompt], Prompt] | None:
    """The task's prompt augmentation z, or None."""
    return next((fn for cls, fn in AUGMENTATIONS.items() if isinstance(task, cls)), None)


def info_problems(config: Any, task: Task) -> list[str]:
    """What keeps Info-GRPO from running: a task without an augmentation, G < 2, or a forward that does not see the
    step's rows together (the term's flags are per row)."""
    problems = []
    if augmentation(task) is None:
        problems.append(f"an answer-preserving augmentation z of task {task.name!r}'s prompts (none is defined)")
    if config.num_generations < 2:
        problems.append(f"num_generations >= 2 (original and augmented rollouts), got {config.num_generations}")
    if config.gradient_accumulation_steps != 1 or getattr(config, "max_tokens_per_microbatch", None) is not None:
        problems.append("one micro-batch per step: gradient_accumulation_steps = 1 and no max_tokens_per_microbatch")
    return problems


class InfoRounds:
    """The sampler: each prompt's group holds G − ⌊G/2⌋ rollouts of it and ⌊G/2⌋ of its augmentation."""

    def __init__(self, augment: Callable[[Prompt], Prompt]) -> None:
        self.augment = augment
        self.augmented: Tensor | None = None  # [B] bool, of the last round

    def __call__(self, source: Source) -> Collected:
        prompts = source.draw()
        half = source.num_generations // 2
        original = source.generate(prompts, source.num_generations - half)
        augmented = source.generate([self.augment(p) for p in prompts], half)
        round = concat([original, Round(prompts, augmented.batch, augmented.scores)], shared_prompts=True)
        rows = len(original.batch.group_ids), len(augmented.batch.group_ids)
        self.augmented = torch.cat([torch.zeros(rows[0], dtype=torch.bool), torch.ones(rows[1], dtype=torch.bool)])
        return Collected(round, None, {"info_grpo/augmented_rows": float(rows[1])})


class InfoPolicy(PolicyModule):
    """`PolicyModule` with Info-GRPO's −λ·[α·H(τ|q) − H(τ|q, z)] added to its loss; `set_step` gives the flags."""

    def __init__(self, model: nn.Module, padding_free: bool = False, **kwargs: Any) -> None:
        super().__init__(model, padding_free)
        self.info_kwargs = kwargs  # alpha, lam
        self.augmented: Tensor | None = None

    def set_step(self, augmented: Tensor) -> None:
        """This rank's augmented flags [B] for the next `forward`."""
        self.augmented = augmented

    def forward(self, batch: UpdateBatch, options: LossOptions) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().forward(batch, options)
        mask = batch.completion_mask
        if self.augmented is None or len(self.augmented) != mask.shape[0]:
            got = None if self.augmented is None else len(self.augmented)
            raise ValueError(f"Info-GRPO: the forward sees {mask.shape[0]} rows, set_step gave flags for {got}")
        _, entropy = policy_logprobs(
            self.model, batch.input_ids, batch.attention_mask, mask, temperature=options.temperature, with_entropy=True
        )  # [B, T] with gradient
        term = info_grpo(entropy, mask, self.augmented.to(mask.device), **self.info_kwargs)
        return loss + term, {**metrics, "info_grpo/term": term.detach()}

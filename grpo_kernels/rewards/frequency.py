"""GAPO frequency reward: valid answers earn more the rarer they are in their group."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Sequence

import torch
from torch import Tensor

from grpo_kernels.checks import check_length, check_texts
from grpo_kernels.groups import group_index
from grpo_kernels.rewards import REWARDS


@REWARDS.register("gapo_frequency", paper="GAPO, arXiv:2511.12596")
def gapo_frequency(
    answer_keys: list[str], valid_answers: Sequence[Collection[str]], group_ids: Tensor | Sequence[Hashable]
) -> Tensor:
    """R̃_i = 1 − (f_i − 1/L) for a valid answer, −1 otherwise: over-represented answers earn less.

    GAPO (Anschel et al., arXiv:2511.12596; spec §3, label *partial*: the equation is from a third-party port
    that follows the paper). `answer_keys[i]` is the canonical answer of completion i; `valid_answers[i]` is its
    prompt's known valid set V (L = |V|); completion i is valid when its key is in V. Within each group,
    f_i = (# valid completions with key_i) / (# valid completions). The reward is linear in f_i − 1/L with no
    absolute value (spec §26 item 4): an answer rarer than the uniform share 1/L gets more than 1, so the policy
    is pushed toward covering V uniformly; grpo-composer's 1 − |f − 1/L| would penalise rare valid answers too.
    Returns [B] float32; follow it with the usual GRPO group normalisation.
    """
    answer_keys = check_texts("answer_keys", answer_keys)
    n = len(answer_keys)
    check_length("valid_answers", valid_answers, n)
    for i, valid in enumerate(valid_answers):
        if len(valid) == 0:
            raise ValueError(f"valid_answers[{i}] must be a non-empty collection of answer keys, got {valid!r}")
    index = group_index(group_ids, n).tolist()
    valid = [key in answers for key, answers in zip(answer_keys, valid_answers, strict=True)]
    counts = Counter((g, key) for g, key, ok in zip(index, answer_keys, valid, strict=True) if ok)
    valid_per_group = Counter(g for g, ok in zip(index, valid, strict=True) if ok)
    rewards = [
        1.0 - (counts[g, key] / valid_per_group[g] - 1.0 / len(answers)) if ok else -1.0
        for g, key, answers, ok in zip(index, answer_keys, valid_answers, valid, strict=True)
    ]
    return torch.tensor(rewards, dtype=torch.float32)

"""DRA-GRPO diversity reward: a reward divided by how redundant its completion is within the group."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo_kernels.checks import check_finite, check_texts, checked_floats
from grpo_kernels.groups import group_index
from grpo_kernels.rewards import REWARDS

Embedder = Callable[[list[str]], Tensor]


@REWARDS.register("dra_diversity", paper="DRA-GRPO, arXiv:2505.09655")
class DiversityReward:
    """r̃_i = r_i / (1 + SMI_i), SMI_i = Σ_{j≠i in i's group} max(cos(e_i, e_j), 0): redundant answers earn less.

    DRA-GRPO (Chen et al., arXiv:2505.09655; spec §5): graph-cut submodular mutual information between a
    completion and the rest of its group, used as an inverse-propensity weight. `embed` is any sentence encoder
    mapping a list of B texts to a tensor [B, d] (the paper uses jina-embeddings-v2-small-en); embeddings are L2-
    normalised, so s_ij is the cosine similarity. Differences from the reference code, both deliberate: the sum
    runs over the completion's own group only (the code sums over every completion on the device, spec §5), and
    negative cosines are clamped to 0 (graph-cut SMI needs a non-negative kernel; this keeps 1 + SMI ≥ 1, where
    the code's 1/(Σ_j s_ij + 1e-6) can change sign or blow up). The paper divides, not grpo-composer's
    r·(1 − SMI) (spec §26 item 3). A group of one has SMI 0 and keeps its reward.
    """

    def __init__(self, embed: Embedder) -> None:
        if not callable(embed):
            raise TypeError(f"embed must be a callable list[str] -> Tensor [B, d], got {type(embed).__name__}")
        self.embed = embed

    def __call__(
        self, completions: list[str], rewards: Tensor | Sequence[float], group_ids: Tensor | Sequence[Hashable]
    ) -> Tensor:
        """Adjusted rewards [B] float32 (on the device of `rewards`)."""
        completions = check_texts("completions", completions)
        n = len(completions)
        rewards = checked_floats("rewards", rewards, (n,), dtype=torch.float32)
        index = group_index(group_ids, n).to(rewards.device)
        embeddings = self.embed(completions)
        if not isinstance(embeddings, Tensor) or embeddings.dim() != 2 or embeddings.shape[0] != n:
            got = list(embeddings.shape) if isinstance(embeddings, Tensor) else type(embeddings).__name__
            raise ValueError(f"embed(completions) must return a tensor [B, d] with B = {n}, got {got}")
        embeddings = embeddings.detach().to(rewards.device, torch.float32)
        check_finite("embed(completions)", embeddings)
        unit = F.normalize(embeddings, dim=-1)  # [B, d]
        same_group = index[:, None] == index[None, :]  # [B, B]
        same_group.fill_diagonal_(False)
        similarity = (unit @ unit.T).clamp(min=0.0) * same_group  # [B, B]
        return rewards / (1.0 + similarity.sum(-1))  # [B]

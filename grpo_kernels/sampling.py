"""Group-level sampling rules of the GRPO family: which prompts to keep, resample, bin, or give more rollouts.

Pure functions of per-sequence tensors (`rewards [B]`, `group_ids [B]`, `correct [B]`), called between rollout and
loss by any trainer. Group ids are arbitrary integers, and groups may differ in size. A group of G rollouts is one
prompt. Everything is registered in `SAMPLERS`. Formulas follow spec/variants.md §6, §7, §13, §20 and §23.5.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_kernels.checks import check_bool, check_ids, checked_floats
from grpo_kernels.groups import (
    group_deviation,
    group_first,
    group_index,
    group_max,
    group_mean,
    group_size,
    group_sum,
    group_varies,
)
from grpo_kernels.registry import Registry

SAMPLERS = Registry("sampler")


# ---------------------------------------------------------------------------------------------------- input checks
def checked_batch(name: str, values: Tensor, group_ids: Tensor, flags: bool = False) -> tuple[Tensor, Tensor]:
    """Checked per-sequence `values` [B] and the dense group index [B] of `group_ids` (an integer tensor [B]).

    `values` are rewards, where bool correctness and integers come back as float64, or with `flags` a bool tensor;
    B >= 1.
    """
    values = check_bool(name, values) if flags else checked_floats(name, values)  # [B]
    return values, group_index(check_ids("group_ids", group_ids, len(values)), len(values))  # [B], [B]


# ------------------------------------------------------------------------------------------------ DAPO (§6)
@SAMPLERS.register("dapo_dynamic", paper="DAPO, arXiv:2503.14476")
def dapo_dynamic(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling: keep groups with 0 < #correct < G, i.e. rewards not all equal -> keep [B] bool.

    DAPO (arXiv:2503.14476) constrains its objective to groups that are neither all correct nor all wrong: those
    have all-zero advantages. `rewards [B]` is whatever verl's `filter_groups.metric` names: correctness (bool
    or 0/1, then the test is 0 < #correct < G) or a scalar score (then: non-zero std within the group). As in verl
    (`std > 0 or len == 1`), a group of one is kept, although its GRPO advantage is 0: with one rollout per
    prompt nothing would pass otherwise.
    """
    rewards, index = checked_batch("rewards", rewards, group_ids)  # [B], [B]
    return group_varies(rewards, index) | (group_size(index) == 1)  # [B]


class DAPORound(NamedTuple):
    """What `DAPOBatchFiller.add` decided about one generation round."""

    keep: Tensor  # [B] bool: this round's sequences that go into the training batch
    generate_more: bool  # the batch is not full yet: generate another round
    num_kept: int  # prompts kept so far for this training batch


class DAPOBatchFiller:
    """Over-generation for DAPO: accumulate the groups `dapo_dynamic` keeps over rounds until a batch is full.

    verl semantics (recipe/dapo, spec §6): each `add` is one generation batch. Its kept groups join the training
    batch until `target_groups` prompts are kept. The round that fills the batch keeps only the groups it needs,
    first-come in batch order. If `max_num_gen_batches` > 0 rounds were generated and the batch is still not full,
    `add` raises ValueError, as verl does, or with `short_batches` ends the batch with the groups it kept
    (`generate_more` False, `num_kept` < `target_groups`). 0 means no limit. After a batch the filler starts a new one.
    """

    def __init__(self, target_groups: int, max_num_gen_batches: int = 0, short_batches: bool = False) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {target_groups}")
        if max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches must be >= 0 (0: no limit), got {max_num_gen_batches}")
        self.target_groups = target_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.short_batches = short_batches
        self.num_gen_batches = 0
        self.num_kept = 0

    def add(self, rewards: Tensor, group_ids: Tensor) -> DAPORound:
        """Filter one generation round (`rewards [B]`, `group_ids [B]`) and say whether to generate more."""
        keep = dapo_dynamic(rewards, group_ids)  # [B]
        index = group_index(group_ids, len(keep))  # [B]
        first = group_first(index)  # [P]
        kept = keep[first]  # [P] one flag per group, every sequence of a group shares it
        order = first.argsort()  # [P] groups in batch order
        rank = torch.empty_like(order).scatter_(0, order, kept[order].long().cumsum(0))  # [P]
        kept = kept & (rank <= self.target_groups - self.num_kept)  # [P]
        self.num_gen_batches += 1
        self.num_kept += int(kept.sum())
        num_kept, rounds = self.num_kept, self.num_gen_batches
        limit_reached = num_kept < self.target_groups and 0 < self.max_num_gen_batches <= rounds
        if limit_reached and self.short_batches:
            self.num_gen_batches = self.num_kept = 0
            return DAPORound(kept[index], False, num_kept)
        if limit_reached:
            self.num_gen_batches = self.num_kept = 0
            raise ValueError(
                f"max_num_gen_batches={self.max_num_gen_batches} generation rounds kept {num_kept} of "
                f"target_groups={self.target_groups} prompts; the data may be too hard or too easy "
                "(max_num_gen_batches=0 never stops)"
            )
        if num_kept == self.target_groups:
            self.num_gen_batches = self.num_kept = 0
        return DAPORound(kept[index], num_kept < self.target_groups, num_kept)


# ------------------------------------------------------------------------------------------------- GPG (§23.5)
class GPGValidity(NamedTuple):
    """Valid sequences of a GPG batch, the gradient correction α and the resampling decision."""

    valid: Tensor  # [B] bool: the sequence's group has non-zero reward std
    num_valid: int  # B_valid
    alpha: float  # α = B / B_valid, at least 1
    generate_more: bool  # B_valid < min_inverse_alpha · B: sample another round


@SAMPLERS.register("gpg_valid", paper="GPG, arXiv:2504.02546")
def gpg_valid(
    rewards: Tensor, group_ids: Tensor, batch_size: int | None = None, min_inverse_alpha: float = 0.5
) -> GPGValidity:
    """GPG: B_valid = sequences in groups with non-zero reward std, α = B / B_valid; resample while B_valid < 0.5·B.

    GPG (arXiv:2504.02546) rescales its loss by α, i.e. divides it by min(1, B_valid / B). B_valid follows the
    official code (AMAP-ML/GPG `gpg_trainer.py`): it counts the groups whose rewards are not all equal (times G,
    the same ratio), not the non-zero rewards that verl's `compute_gpg_outcome_advantage` counts (spec §26 item
    8). With unequal group sizes B_valid counts sequences. To resample, pass the rounds generated so far
    concatenated, with `batch_size` = B, the size of one round: valid groups then accumulate over rounds, as in
    the official loop, and α never falls below 1. A group of one is invalid (its advantage r − mean is 0).
    B_valid = 0 gives α = B, which is harmless because every advantage is then 0.
    """
    rewards, index = checked_batch("rewards", rewards, group_ids)  # [B], [B]
    batch_size = len(rewards) if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 < min_inverse_alpha <= 1:
        raise ValueError(f"min_inverse_alpha must be in (0, 1], got {min_inverse_alpha}")
    valid = group_varies(rewards, index)  # [B]
    num_valid = int(valid.sum())
    alpha = batch_size / min(max(num_valid, 1), batch_size)
    return GPGValidity(valid, num_valid, alpha, num_valid < min_inverse_alpha * batch_size)


# ------------------------------------------------------------------------------------------------ DARO (§7)
class DifficultyBins(NamedTuple):
    """Each sequence's pass-rate bin; prompts with μ = 0 or μ = 1 drop out (bin −1)."""

    bins: Tensor  # [B] long in 0..num_bins-1, or −1
    pass_rate: Tensor  # [B] μ of the sequence's prompt, float64
    num_bins: int


@SAMPLERS.register("daro_buckets", paper="DARO, arXiv:2510.09001")
def daro_buckets(correct: Tensor, group_ids: Tensor, num_bins: int | None = None) -> DifficultyBins:
    """DARO difficulty bins: μ = #correct/G per prompt -> bin ⌈μ·K⌉ − 1 of K; μ ∈ {0, 1} drops out (−1).

    DARO (arXiv:2510.09001) treats each pass rate μ ∈ {1/G, …, (G−1)/G} as one task. With equal group sizes
    and `num_bins=None`, K = G − 1 and the bin is #correct − 1: one bin per μ. Otherwise give K. The bins are
    then K equal widths, right-closed: (0, 1/K], (1/K, 2/K], …, ((K−1)/K, 1). The bin is computed in integers,
    ⌈c·K/n⌉ − 1, so μ on a bin edge is exact.
    """
    correct, index = checked_batch("correct", correct, group_ids, flags=True)  # [B], [B]
    hits, sizes = group_sum(correct.long(), index), group_size(index)  # [B], [B]
    if num_bins is None:
        if (sizes != sizes[0]).any():
            raise ValueError(f"group sizes differ ({sizes.unique().tolist()}): pass num_bins")
        num_bins = int(sizes[0]) - 1
    if num_bins < 0:
        raise ValueError(f"num_bins must be >= 0, got {num_bins}")
    informative = (hits > 0) & (hits < sizes)  # [B]
    bins = torch.where(informative, (hits * num_bins + sizes - 1) // sizes - 1, -1)  # [B]
    return DifficultyBins(bins, hits.double() / sizes, num_bins)


# ------------------------------------------------------------------------------------------------ PVPO (§13)
class PVPOSelection(NamedTuple):
    """Per-prompt decisions from the reference policy's pre-rollouts."""

    prompt_ids: Tensor  # [P] group ids, sorted
    accuracy: Tensor  # [P] reference accuracy, float64
    keep: Tensor  # [P] bool: not trivial (accuracy < 1)
    inject_gt: Tensor  # [P] bool: accuracy 0, so a ground-truth trajectory joins the group


@SAMPLERS.register("pvpo_filter", paper="PVPO, arXiv:2508.21104")
def pvpo_filter(ref_correct: Tensor, group_ids: Tensor) -> PVPOSelection:
    """PVPO group sampling: drop prompts the reference policy always solves; inject a GT trajectory where it never does.

    PVPO (arXiv:2508.21104) rolls out the fixed reference policy before training. Here `ref_correct [M·P]` holds
    that pre-rollout's correctness, and `group_ids` its prompt ids. A prompt with accuracy 1 is trivial and
    dropped. A prompt with accuracy 0 is kept and flagged: the trainer adds a cached ground-truth trajectory, from a
    larger LLM, to its group. How the importance ratio treats that trajectory is not verified (spec §13).
    """
    ref_correct, index = checked_batch("ref_correct", ref_correct, group_ids, flags=True)  # [B], [B]
    first = group_first(index)  # [P]
    accuracy = group_mean(ref_correct.double(), index)[first]  # [P]
    return PVPOSelection(group_ids[first], accuracy, accuracy < 1, accuracy == 0)


# ------------------------------------------------------------------------------------------------ XRPO (§20)
@lru_cache(maxsize=4096)
def student_t_quantile(q: float, df: int) -> float:
    """The q-quantile (q ≥ 0.5) of Student's t with integer `df` ≥ 1 degrees of freedom, to float64 precision.

    Bisection on θ = atan(t/√df) of the closed-form two-sided probability A(t|df) = P(|T| < t), Abramowitz &
    Stegun 26.7.3 (odd df) and 26.7.4 (even df); then t = √df · tan θ.
    """
    if df < 1 or not 0.5 <= q < 1:
        raise ValueError(f"student_t_quantile needs df >= 1 and 0.5 <= q < 1, got df={df}, q={q}")

    def two_sided(theta: float) -> float:
        s, c = math.sin(theta), math.cos(theta)
        term, total = (1.0, 1.0) if df % 2 == 0 else (c, c if df > 1 else 0.0)
        for k in range(2 if df % 2 == 0 else 3, df - 1, 2):  # series in cos²θ up to cos^(df−2)θ
            term *= c * c * (k - 1) / k
            total += term
        return s * total if df % 2 == 0 else 2 / math.pi * (theta + s * total)

    lo, hi = 0.0, math.pi / 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if two_sided(mid) < 2 * q - 1 else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def _half_width(n: int, std: float, confidence: float) -> float:
    """h(n) = t_{1−α/2, n−1} · s / √n; infinite below two rollouts (no variance estimate yet)."""
    return math.inf if n < 2 else student_t_quantile(confidence, n - 1) * std / math.sqrt(n)


def _gain(n: int, std: float, confidence: float) -> float:
    """Δh = h(n) − h(n + 1) at fixed s: what one more rollout buys; infinite below two rollouts."""
    return math.inf if n < 2 else _half_width(n, std, confidence) - _half_width(n + 1, std, confidence)


class XRPOAllocation(NamedTuple):
    """Extra rollouts per prompt for the next round."""

    prompt_ids: Tensor  # [P] group ids, sorted
    extra: Tensor  # [P] long: more rollouts for each prompt, summing to the budget
    half_width: Tensor  # [P] h_q(n_q) of the rollouts so far, float64 (inf below 2 rollouts)
    needs_seeding: Tensor  # [P] bool: no rollout has a positive reward (in-context seeding, outside)


@SAMPLERS.register("xrpo_allocate", paper="XRPO, arXiv:2510.06672")
def xrpo_allocate(
    rewards: Tensor, group_ids: Tensor, budget: int, alpha: float = 0.05, exploration: float = 1.0
) -> XRPOAllocation:
    """XRPO rollout allocation: rollouts one at a time to the max of Δh_q + c·√(ln N / n_q), h_q = t·s_q/√n_q.

    XRPO (arXiv:2510.06672) measures a prompt's uncertainty by the Student-t half-width h_q(n) =
    t_{1−α/2, n−1}·s_q/√n of its mean reward, from the `rewards` of all rounds so far. It gives more rollouts to
    the prompts whose h would shrink most, plus an exploration bonus. Greedily, `budget` times: the prompt with the
    largest Π_q = h_q(n_q) − h_q(n_q + 1) + c·√(ln N / n_q) gets one rollout, with s_q held fixed and N = Σ n_q.
    Ties go to the smaller group id. The Δh-plus-UCB-bonus form and c = `exploration` are the spec's reading
    (§20, partial): the paper's exact bonus was not retrieved. Prompts with < 2 rollouts come first.
    """
    rewards, index = checked_batch("rewards", rewards, group_ids)  # [B], [B]
    first = group_first(index)  # [P]
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    confidence = 1 - alpha / 2
    sizes = group_size(index)[first]  # [P]
    std = group_deviation(rewards, index)[2][first]  # [P] unbiased
    std, counts, n = std.tolist(), sizes.tolist(), sizes.double().cpu()
    half_width = [_half_width(k, s, confidence) for k, s in zip(counts, std, strict=True)]
    gain = torch.tensor([_gain(k, s, confidence) for k, s in zip(counts, std, strict=True)], dtype=torch.float64)
    extra = torch.zeros(len(counts), dtype=torch.long)  # [P]
    total = float(sum(counts))
    for _ in range(budget):
        priority = gain + exploration * torch.sqrt(math.log(total) / n)  # [P]
        q = int(priority.argmax())
        extra[q] += 1
        n[q] += 1
        total += 1
        gain[q] = _gain(int(n[q]), std[q], confidence)
    needs_seeding = group_max(rewards, index)[first] <= 0  # [P]
    device = rewards.device
    return XRPOAllocation(group_ids[first], extra.to(device), torch.tensor(half_width, device=device), needs_seeding)

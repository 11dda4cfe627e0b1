"""Sampling rules: a hand-worked example per registered sampler, the edge cases, input checks and the registry.

Every expected value is a literal derived in a comment from the paper's rule (spec/variants.md §6, §7, §13, §20,
§23.5); none is recomputed by a second implementation. Group ids are deliberately unsorted and non-contiguous.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_kernels.sampling import (
    SAMPLERS,
    DAPOBatchFiller,
    dapo_dynamic,
    daro_buckets,
    gpg_valid,
    pvpo_filter,
    student_t_quantile,
    xrpo_allocate,
)


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def ids(values):
    return torch.tensor(values, dtype=torch.long)


def flags(values):
    return torch.tensor(values, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------------ DAPO
def test_dapo_dynamic_keeps_mixed_groups():
    # group 7: correct 1,0,1 -> 0 < 2 < 3, kept      group 3: 0,0 -> all wrong, dropped
    # group 9: 1,1,1,1 -> all right, dropped         group 5: a group of one, kept (verl: `len == 1`)
    # group 4: scores 0.5, 0.7 (unequal size 2) -> std > 0, kept
    rewards = t([1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0.5, 0.7])
    groups = ids([7, 3, 3, 7, 9, 9, 9, 7, 9, 5, 4, 4])
    keep = dapo_dynamic(rewards, groups)
    assert keep.tolist() == [True, False, False, True, False, False, False, True, False, True, True, True]


def test_dapo_dynamic_accepts_bool_correctness_and_zero_variance_scores():
    # bool correctness: group 0 = T,F (mixed), group 1 = F,F; scores 0.3,0.3 have zero variance -> dropped
    assert dapo_dynamic(flags([True, False, False, False]), ids([0, 0, 1, 1])).tolist() == [True, True, False, False]
    assert dapo_dynamic(t([0.3, 0.3, 0.3]), ids([2, 2, 2])).tolist() == [False, False, False]


def test_dapo_filler_accumulates_until_target_then_truncates_in_batch_order():
    filler = DAPOBatchFiller(target_groups=3, max_num_gen_batches=3)
    # round 1: groups 0 (mixed), 1 (all wrong), 2 (mixed), 3 (all right) -> 2 kept, 1 more needed
    first = filler.add(t([1, 0, 0, 0, 0, 1, 1, 1]), ids([0, 0, 1, 1, 2, 2, 3, 3]))
    assert first.keep.tolist() == [True, True, False, False, True, True, False, False]
    assert (first.generate_more, first.num_kept) == (True, 2)
    # round 2: groups 7 and 5 are both mixed; 7 comes first in the batch (though 5 < 7), so only 7 joins
    second = filler.add(t([1, 0, 0, 1, 1, 1]), ids([7, 7, 5, 5, 9, 9]))
    assert second.keep.tolist() == [True, True, False, False, False, False]
    assert (second.generate_more, second.num_kept) == (False, 3)
    # a full batch starts a new one
    third = filler.add(t([1, 0]), ids([0, 0]))
    assert (third.generate_more, third.num_kept) == (True, 1)


def test_dapo_filler_raises_at_max_num_gen_batches_and_zero_means_no_limit():
    filler = DAPOBatchFiller(target_groups=5, max_num_gen_batches=2)
    filler.add(t([1, 0, 1, 1]), ids([0, 0, 1, 1]))  # 1 kept
    with pytest.raises(ValueError, match=r"max_num_gen_batches=2 generation rounds kept 2 of target_groups=5"):
        filler.add(t([0, 1, 0, 0]), ids([0, 0, 1, 1]))  # 2 kept after 2 rounds
    short = DAPOBatchFiller(target_groups=5, max_num_gen_batches=2, short_batches=True)
    short.add(t([1, 0, 1, 1]), ids([0, 0, 1, 1]))
    ended = short.add(t([0, 1, 0, 0]), ids([0, 0, 1, 1]))  # the limit ends the batch with the 2 groups kept
    assert (ended.keep.tolist(), ended.generate_more, ended.num_kept) == ([True, True, False, False], False, 2)
    assert short.add(t([1, 0]), ids([0, 0])).num_kept == 1  # and the next round starts a new batch
    unlimited = DAPOBatchFiller(target_groups=2, max_num_gen_batches=0)
    for _ in range(10):
        assert unlimited.add(t([1, 1]), ids([0, 0])).generate_more
    with pytest.raises(ValueError, match="target_groups must be >= 1"):
        DAPOBatchFiller(target_groups=0)


# ------------------------------------------------------------------------------------------------------- GPG
def test_gpg_alpha_counts_valid_groups_not_nonzero_rewards():
    # spec §26 item 8. B = 12, G = 4: group 0 = 1,0,0,0 (std > 0), group 1 = 0,0,0,0, group 2 = 1,1,1,1.
    # official GPG: B_valid = 4 samples of the one valid group -> α = 12/4 = 3.0
    # verl compute_gpg_outcome_advantage: count_nonzero(rewards) = 1 + 4 = 5 -> α = 12/5 = 2.4 (not what we do)
    out = gpg_valid(t([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]), ids([0] * 4 + [1] * 4 + [2] * 4))
    assert out.valid.tolist() == [True] * 4 + [False] * 8
    assert out.num_valid == 4
    assert out.alpha == 3.0 and out.alpha != 12 / 5
    assert out.generate_more  # 4 < 0.5 · 12 = 6: keep sampling


def test_gpg_resampling_accumulates_rounds():
    # round 1 as above (4 valid); round 2 = groups 3: 1,0,1,0 and 4: 1,1,0,0 valid, 5: 0,0,0,0 -> 8 valid
    # concatenated with batch_size = 12: B_valid = 12 >= 6 -> stop; α = 12 / min(12, 12) = 1.0
    rewards = t([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1] + [1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    out = gpg_valid(rewards, ids([g for g in range(6) for _ in range(4)]), batch_size=12)
    assert (out.num_valid, out.alpha, out.generate_more) == (12, 1.0, False)
    # more valid samples than one round holds: α is never below 1
    assert gpg_valid(t([1, 0, 1, 0]), ids([0, 0, 1, 1]), batch_size=2).alpha == 1.0


def test_gpg_unequal_groups_singletons_and_no_valid_group():
    # sizes 3, 1, 2: group 0 = 1,0,0 valid (3 samples); group 1 (one) invalid; group 2 = 0.5,0.5 invalid
    # B_valid = 3 of B = 6 -> α = 2.0; 3 >= 0.5 · 6 -> stop
    out = gpg_valid(t([1, 0, 0, 1, 0.5, 0.5]), ids([0, 0, 0, 1, 2, 2]))
    assert (out.valid.tolist(), out.num_valid, out.alpha, out.generate_more) == (
        [True, True, True, False, False, False],
        3,
        2.0,
        False,
    )
    # no valid group: α = B / max(B_valid, 1) = 4 (every advantage is 0, so the loss is 0 anyway)
    none = gpg_valid(t([1, 1, 0, 0]), ids([0, 0, 1, 1]))
    assert (none.num_valid, none.alpha, none.generate_more) == (0, 4.0, True)


# ------------------------------------------------------------------------------------------------------ DARO
def test_daro_buckets_one_bin_per_pass_rate():
    # G = 4, #correct per group 0, 1, 2, 3, 4 -> μ = 0 (out), 1/4, 2/4, 3/4, 1 (out); K = G − 1 = 3, bin = #correct − 1
    correct = flags([0, 0, 0, 0] + [1, 0, 0, 0] + [0, 1, 0, 1] + [1, 1, 0, 1] + [1, 1, 1, 1])
    groups = ids([g for g in (4, 8, 1, 6, 3) for _ in range(4)])
    out = daro_buckets(correct, groups)
    assert out.num_bins == 3
    assert out.bins.tolist() == [-1] * 4 + [0] * 4 + [1] * 4 + [2] * 4 + [-1] * 4
    assert out.pass_rate.tolist() == [0.0] * 4 + [0.25] * 4 + [0.5] * 4 + [0.75] * 4 + [1.0] * 4


def test_daro_buckets_unequal_groups_need_num_bins():
    # sizes 3, 2, 5, 1 with K = 2 bins (0, 1/2], (1/2, 1): bin = ⌈c·K/n⌉ − 1
    #   c=1, n=3: μ = 1/3 -> ⌈2/3⌉ − 1 = 0     c=1, n=2: μ = 1/2 (edge) -> ⌈1⌉ − 1 = 0
    #   c=4, n=5: μ = 4/5 -> ⌈8/5⌉ − 1 = 1     n=1: μ ∈ {0, 1} always -> −1
    correct = flags([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1])
    groups = ids([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3])
    with pytest.raises(ValueError, match=r"group sizes differ \(\[1, 2, 3, 5\]\): pass num_bins"):
        daro_buckets(correct, groups)
    assert daro_buckets(correct, groups, num_bins=2).bins.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1]


# ------------------------------------------------------------------------------------------------------ PVPO
def test_pvpo_filter_drops_trivial_and_flags_hard_prompts():
    # reference pre-rollouts: prompt 20 = 0,0,0 (accuracy 0: keep, inject GT); prompt 10 = 1,1,1 (accuracy 1:
    # trivial, drop); prompt 30 = 1,0,0,1 (accuracy 0.5: keep, no injection)
    out = pvpo_filter(flags([0, 1, 0, 1, 1, 0, 0, 1, 1, 0]), ids([20, 10, 20, 30, 10, 30, 20, 10, 30, 30]))
    assert out.prompt_ids.tolist() == [10, 20, 30]
    assert out.accuracy.tolist() == [1.0, 0.0, 0.5]
    assert out.keep.tolist() == [False, True, True]
    assert out.inject_gt.tolist() == [False, True, False]


# ------------------------------------------------------------------------------------------------------ XRPO
def test_student_t_quantile_matches_tables():
    # two-sided 95 % critical values t_{0.975, df}, and t_{0.995, 1}, from standard t tables
    table = {1: 12.7062047, 2: 4.3026527, 3: 3.1824463, 4: 2.7764451, 9: 2.2621572, 10: 2.2281389, 30: 2.0422725}
    for df, value in table.items():
        assert student_t_quantile(0.975, df) == pytest.approx(value, abs=1e-6)
    assert student_t_quantile(0.995, 1) == pytest.approx(63.6567412, abs=1e-6)


def test_xrpo_allocate_worked_example():
    # prompt 0: rewards 1,0,1,0 -> s = √(4·0.25/3) = √(1/3) = 0.577350; prompt 1: 1,1,1,1 -> s = 0, Δh = 0
    # h(n) = t_{0.975, n−1}·s/√n: h(4) = 3.182446·0.577350/2 = 0.918693, h(5) = 2.776445·s/√5 = 0.716875,
    #   h(6) = 2.570582·s/√6 = 0.605892, h(7) = 2.446912·s/√7 = 0.533960
    # Π = Δh + √(ln N / n), N = Σ n:
    #   grant 1 (N=8):  Π_0 = 0.201818 + √(ln 8/4) = 0.922831,  Π_1 = 0 + 0.721013            -> prompt 0
    #   grant 2 (N=9):  Π_0 = 0.110983 + √(ln 9/5) = 0.773890,  Π_1 = √(ln 9/4) = 0.741152    -> prompt 0
    #   grant 3 (N=10): Π_0 = 0.071932 + √(ln 10/6) = 0.691419, Π_1 = √(ln 10/4) = 0.758714  -> prompt 1
    rewards, groups = t([1, 0, 1, 0, 1, 1, 1, 1]), ids([5, 5, 5, 5, 9, 9, 9, 9])
    assert [xrpo_allocate(rewards, groups, budget).extra.tolist() for budget in range(4)] == [
        [0, 0],
        [1, 0],
        [2, 0],
        [2, 1],
    ]
    out = xrpo_allocate(rewards, groups, 3)
    assert out.prompt_ids.tolist() == [5, 9]
    assert out.half_width.tolist() == pytest.approx([0.918693, 0.0], abs=1e-6)
    assert out.needs_seeding.tolist() == [False, False]


def test_xrpo_allocate_singletons_first_and_zero_reward_seeding():
    # prompt 2 has one rollout (no variance estimate: h = inf), so it gets grant 1. Then s_2 stays 0 (held fixed),
    # and with N = 8: Π_1 = 0.201818 + √(ln 8/4) = 0.922831 (as above), Π_2 = Π_3 = 0 + √(ln 8/2) = 1.019667;
    # the tie goes to the smaller id: prompt 2 again. Prompt 3 (rewards all 0) needs in-context seeding.
    out = xrpo_allocate(t([1, 0, 1, 0, 1, 0, 0]), ids([1, 1, 1, 1, 2, 3, 3]), budget=2)
    assert out.half_width[1].item() == math.inf
    assert out.extra.tolist() == [0, 2, 0]
    assert out.needs_seeding.tolist() == [False, False, True]


# ------------------------------------------------------------------------------------------------ input checks
CALLS = {
    "dapo_dynamic": lambda r, g: dapo_dynamic(r, g),
    "gpg_valid": lambda r, g: gpg_valid(r, g),
    "xrpo_allocate": lambda r, g: xrpo_allocate(r, g, 2),
    "filler": lambda r, g: DAPOBatchFiller(1).add(r, g),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_are_rejected(name, bad):
    with pytest.raises(ValueError, match=rf"rewards must be finite, got {bad} at index 2"):
        CALLS[name](t([1, 0, bad, 1]), ids([0, 0, 1, 1]))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_shape_mismatches_are_rejected(name):
    with pytest.raises(ValueError, match=r"group_ids must be \[B\] = \[4\], got \[3\]"):
        CALLS[name](t([1, 0, 0, 1]), ids([0, 0, 1]))
    with pytest.raises(ValueError, match=r"rewards must be a non-empty \[B\] tensor, got \[2, 2\]"):
        CALLS[name](t([[1, 0], [0, 1]]), ids([0, 0, 1, 1]))
    with pytest.raises(TypeError, match="group_ids must be an integer tensor, got torch.float64"):
        CALLS[name](t([1, 0, 0, 1]), t([0, 0, 1, 1]))


def test_correctness_must_be_bool():
    with pytest.raises(TypeError, match="correct must be a bool tensor, got torch.int64"):
        daro_buckets(ids([1, 0]), ids([0, 0]))
    with pytest.raises(TypeError, match="ref_correct must be a bool tensor, got torch.float64"):
        pvpo_filter(t([1, 0]), ids([0, 0]))
    with pytest.raises(ValueError, match=r"group_ids must be \[B\] = \[2\]"):
        pvpo_filter(flags([1, 0]), ids([0]))


# ------------------------------------------------------------------------------------------------------ registry
def test_registry_lists_every_sampler_with_its_paper():
    assert SAMPLERS.names() == ["dapo_dynamic", "daro_buckets", "gpg_valid", "pvpo_filter", "xrpo_allocate"]
    papers = {c.name: c.paper for c in SAMPLERS}
    assert papers == {
        "dapo_dynamic": "DAPO, arXiv:2503.14476",
        "gpg_valid": "GPG, arXiv:2504.02546",
        "daro_buckets": "DARO, arXiv:2510.09001",
        "pvpo_filter": "PVPO, arXiv:2508.21104",
        "xrpo_allocate": "XRPO, arXiv:2510.06672",
    }
    assert all(c.summary for c in SAMPLERS)
    assert SAMPLERS.get("gpg_valid") is gpg_valid


def test_unknown_sampler_lists_valid_choices():
    valid = r"\['dapo_dynamic', 'daro_buckets', 'gpg_valid', 'pvpo_filter', 'xrpo_allocate'\]"
    with pytest.raises(ValueError, match=rf"unknown sampler 'dapo'; valid choices: {valid}"):
        SAMPLERS.get("dapo")

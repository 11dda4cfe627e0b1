"""Advantage estimators: a hand-worked example per registry entry, the spec §26 port pitfalls, edge cases, checks.

Expected numbers are derived by hand from each paper's formula (arithmetic in the comments; std is the unbiased
one, e.g. std{1, 0, 0} = √((4/9 + 1/9 + 1/9)/2) = √(1/3) = 0.57735); the tests hold literals, never a second
implementation. Worked examples pass eps = 0 where eps would only blur the hand arithmetic; zero-variance groups
still give exactly 0 then.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_kernels.advantages import ADVANTAGES, KalmanState

F64 = torch.float64
NAMES = [
    "dr_grpo",
    "gdpo",
    "grpo",
    "grpo_lead",
    "grpo_s",
    "gtpo",
    "krpo",
    "ms_grpo",
    "pvpo",
    "rank_grpo",
    "reinforce_pp",
    "rloo",
    "stratified",
    "tic_grpo",
    "xrpo",
]


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def adv(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **kwargs) -> list:
    return ADVANTAGES.get(name)(rewards, group_ids, **kwargs).tolist()


# ---------------------------------------------------------------------------------------------------- registry


def test_registry_lists_every_estimator():
    assert ADVANTAGES.names() == sorted(NAMES)
    for component in ADVANTAGES:
        assert component.paper.startswith(("arXiv:", "OpenReview:")), component.name
        assert component.summary, f"{component.name} has no docstring summary"


def test_unknown_name_lists_the_valid_choices():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpoo'; valid choices: \['dr_grpo', 'gdpo'"):
        ADVANTAGES.get("grpoo")


# ------------------------------------------------------------------------------------------- worked examples


def test_grpo_worked_example_unequal_non_contiguous_groups():
    # group 7 = positions 0, 2, 4: r = {1, 0, 0}, mean 1/3, std √(1/3) = 0.57735
    #   A = (2/3)/0.57735 = 1.154701, (−1/3)/0.57735 = −0.577350
    # group 3 = positions 1, 3: r = {0, 1}, mean 1/2, std √((1/4 + 1/4)/1) = 0.707107 -> A = ∓0.5/0.707107 = ∓0.707107
    out = adv("grpo", t(1, 0, 0, 1, 0), ids(7, 3, 7, 3, 7), eps=0.0)
    assert out == pytest.approx([1.154701, -0.707107, -0.577350, 0.707107, -0.577350], rel=1e-6)


def test_grpo_eps_default_is_verls_and_trls_is_an_option():
    # eps sits next to the std: verl 1e-6 -> 0.5/(0.707107 + 1e-6) = 0.707106; TRL 1e-4 -> 0.5/0.707207 = 0.707007
    assert adv("grpo", t(1, 0), ids(0, 0))[0] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-12)
    assert adv("grpo", t(1, 0), ids(0, 0), eps=1e-4)[0] == pytest.approx(0.707007, rel=1e-6)


def test_dr_grpo_worked_example():
    # r − mean_G, no std: group 7 mean 1/3 -> 2/3, −1/3, −1/3; group 3 mean 1/2 -> −1/2, +1/2
    out = adv("dr_grpo", t(1, 0, 0, 1, 0), ids(7, 3, 7, 3, 7))
    assert out == pytest.approx([2 / 3, -0.5, -1 / 3, 0.5, -1 / 3], rel=1e-12)


def test_rloo_worked_example():
    # G/(G−1)·(r − mean_G) = r − mean of the others:
    #   group 7 (G = 3): 3/2·(2/3) = 1 = 1 − mean{0, 0};   3/2·(−1/3) = −0.5 = 0 − mean{1, 0}
    #   group 3 (G = 2): 2·(∓1/2) = ∓1 = r − the other's r;   group 1 (G = 1): no other sample -> 0
    out = adv("rloo", t(1, 0, 0, 1, 0, 5), ids(7, 3, 7, 3, 7, 1))
    assert out == pytest.approx([1.0, -1.0, -0.5, 1.0, -0.5, 0.0], rel=1e-12, abs=1e-15)


def test_reinforce_pp_worked_example():
    # Ã = r − mean_G = [2/3, −1/2, −1/3, 1/2, −1/3]; batch mean 0;
    # unbiased var = (4/9 + 1/4 + 1/9 + 1/4 + 1/9)/4 = (7/6)/4 = 0.2916667; A = Ã/√(0.2916667 + 1e-8) = Ã·1.851640
    out = adv("reinforce_pp", t(1, 0, 0, 1, 0), ids(7, 3, 7, 3, 7))
    assert out == pytest.approx([1.234427, -0.925820, -0.617213, 0.925820, -0.617213], rel=1e-6)


def test_reinforce_pp_lengths_weight_the_batch_like_verls_token_whitening():
    # Ã = [1/2, −1/2, 0, 0]; lengths [3, 1, 2, 2] -> 8 tokens; token mean = (3·0.5 − 0.5)/8 = 0.125;
    # var = (3·0.375² + 0.625² + 4·0.125²)/(8 − 1) = 0.875/7 = 0.125, std 0.353553
    # A = (Ã − 0.125)/0.353553 = [1.060660, −1.767767, −0.353553, −0.353553]
    out = adv("reinforce_pp", t(1, 0, 1, 1), ids(0, 0, 1, 1), lengths=ids(3, 1, 2, 2))
    assert out == pytest.approx([1.060660, -1.767767, -0.353553, -0.353553], rel=1e-5)


def test_krpo_worked_example():
    # Q = 1e-5, R = 1e-2, from x0 = 0, P0 = 1; group rewards in order [1, 0, 1]:
    # j=1: P⁻ = 1.00001, K = 1.00001/1.01001 = 0.9900991, x = 0.9900991, P = (1 − K)P⁻ = 0.00990099
    #      A = (1 − 0.9900991)/√0.00990099 = 0.0099009/0.0995037 = 0.099503
    # j=2: P⁻ = 0.00991099, K = 0.4977648, x = 0.9900991 + K(0 − 0.9900991) = 0.4972626, P = 0.00497765
    #      A = (0 − 0.4972626)/0.0705525 = −7.048125
    # j=3: P⁻ = 0.00498765, K = 0.3327839, x = 0.4972626 + K(1 − 0.4972626) = 0.6645655, P = 0.00332784
    #      A = (1 − 0.6645655)/0.0576874 = 5.814689
    out = adv("krpo", t(1, 0, 1), ids(4, 4, 4))
    assert out == pytest.approx([0.099503, -7.048125, 5.814689], rel=1e-5)


def test_krpo_restarts_the_filter_for_every_group():
    # Spec §26.2: the official code re-initialises x = 0, P = 1 per group (the composer carries it across), so two
    # groups with the same rewards get the same advantages, contiguous or interleaved.
    contiguous = adv("krpo", t(1, 0, 1, 1, 0, 1), ids(0, 0, 0, 1, 1, 1))
    assert contiguous == pytest.approx([0.099503, -7.048125, 5.814689] * 2, rel=1e-5)
    interleaved = adv("krpo", t(1, 1, 0, 0, 1, 1), ids(5, 2, 5, 2, 5, 2))
    assert interleaved == pytest.approx([0.099503, 0.099503, -7.048125, -7.048125, 5.814689, 5.814689], rel=1e-5)


def test_krpo_depends_on_sampling_order_and_is_not_zero_on_equal_rewards():
    # Reordering [1, 0, 1] to [1, 1, 0] changes the scan: the filter lags, so equal rewards also get A ≠ 0
    # ([1, 1, 1]: 0.099503, 0.070481, 0.057513 — the first ≈ 0.1·r_1).
    assert adv("krpo", t(1, 1, 0), ids(0, 0, 0))[0:2] == pytest.approx([0.099503, 0.070481], rel=1e-4)
    assert adv("krpo", t(1, 1, 1), ids(0, 0, 0)) == pytest.approx([0.099503, 0.070481, 0.057513], rel=1e-4)


def test_krpo_persistent_state_is_the_non_official_mode():
    # With a KalmanState the filter of prompt 9 continues from its posterior (x = 0.6645655, P = 0.00332784 after
    # [1, 0, 1]); a next reward 0 then gives P⁻ = 0.00333784, K = 0.2502500, x = 0.4982580, P = 0.00250252,
    # A = −0.4982580/0.0500252 = −9.960067 instead of the fresh filter's first-sample −0.099503.
    state = KalmanState()
    adv("krpo", t(1, 0, 1), ids(9, 9, 9), state=state)
    assert state.filters[9] == pytest.approx((0.6645655, 0.00332784), rel=1e-6)
    assert adv("krpo", t(0.0), ids(9), state=state) == pytest.approx([-9.960067], rel=1e-6)
    assert adv("krpo", t(0.0), ids(9)) == pytest.approx([0.0], abs=1e-12)  # fresh: x = 0 = r -> 0
    assert adv("krpo", t(0.0), ids(3), state=state) == pytest.approx([0.0], abs=1e-12)  # unseen prompt: fresh


def test_pvpo_worked_example():
    # A = r − V̂, with V̂ the cached reference mean reward of the prompt; no std division
    out = adv("pvpo", t(1, 0, 1, 0), ids(0, 0, 1, 1), reference_value=t(0.25, 0.25, 0.75, 0.75))
    assert out == pytest.approx([0.75, -0.25, 0.25, -0.75], rel=1e-12)


def test_pvpo_reference_value_must_be_one_per_prompt():
    with pytest.raises(ValueError, match="reference_value must be equal within each group"):
        adv("pvpo", t(1, 0), ids(0, 0), reference_value=t(0.2, 0.3))


def test_gdpo_worked_example_keeps_reward_combinations_apart():
    # K = 2 rewards; group 0 = [(1, 0), (0, 0)], group 1 = [(1, 1), (0, 0)].
    # GRPO sums first: sums [1, 0] and [2, 0] both normalise to ±0.707107 — the better group 1 is not told apart.
    # GDPO per reward (G = 2, std of two unequal values = |a − b|/√2): group 0: a_·0 = ±0.707107, a_·1 = 0 (equal);
    # group 1: a_·0 = ±0.707107, a_·1 = ±0.707107. Sum: ã = [0.707107, −0.707107, 1.414214, −1.414214];
    # batch mean 0, var = (0.5 + 0.5 + 2 + 2)/3 = 5/3, std 1.290994 -> A = ã/1.290994
    rewards = t(1, 0, 0, 0, 1, 1, 0, 0).view(4, 2)
    assert adv("grpo", rewards.sum(1), ids(0, 0, 1, 1), eps=0.0) == pytest.approx([0.707107, -0.707107] * 2, rel=1e-6)
    out = adv("gdpo", rewards, ids(0, 0, 1, 1), eps=0.0)
    assert out == pytest.approx([0.547723, -0.547723, 1.095445, -1.095445], rel=1e-6)
    # weights [1, 0.5]: ã = [0.707107, −0.707107, 1.060660, −1.060660]; var = (1 + 2·1.125)/3 = 1.083333,
    # std 1.040833 -> A = [0.679366, −0.679366, 1.019049, −1.019049]
    out = adv("gdpo", rewards, ids(0, 0, 1, 1), weights=[1.0, 0.5], eps=0.0)
    assert out == pytest.approx([0.679366, -0.679366, 1.019049, -1.019049], rel=1e-6)


def test_gdpo_default_eps_is_1e_4_in_both_normalisations():
    # one group [(1,), (0,)]: a = ±0.5/(0.707107 + 1e-4) = ±0.707007; batch std of ±0.707007 = 0.999859
    # A = 0.707007/(0.999859 + 1e-4) = 0.707007/0.999959 = 0.707036
    assert adv("gdpo", t(1, 0).view(2, 1), ids(0, 0))[0] == pytest.approx(0.707036, rel=1e-5)


def test_ms_grpo_worked_example():
    # Default 4 scales from G down to 2. Group 5 (G = 3, positions 0, 2, 4, r = {1, 0, 0}): sizes 3, 2.67, 2.33, 2
    # round to τ ∈ {3, 2}; C(2, τ−1) ≤ 4 subgroups, so all are used (deterministic).
    #   τ = 3 (with std): the whole group = GRPO: 1.154701, −0.577350, −0.577350
    #   τ = 2 (mean-only): member 0: {1,0}, {1,0} -> (1 − 0.5) = 0.5; member 2: {0,1} -> −0.5, {0,0} -> 0: mean −0.25
    #   A = (τ3 + τ2)/2 = [0.827350, −0.413675, −0.413675]
    # Group 2 (G = 2, positions 1, 3, r = {0, 1}): only τ = 2, mean-only: ∓0.5
    out = adv("ms_grpo", t(1, 0, 0, 1, 0), ids(5, 2, 5, 2, 5), eps=0.0)
    assert out == pytest.approx([0.827350, -0.5, -0.413675, 0.5, -0.413675], rel=1e-6)


def test_ms_grpo_single_scale_is_grpo():
    rewards, group_ids = t(1, 0, 0.5, 1, 0.2, 0.9, 0.9, 0.1), ids(0, 0, 0, 0, 1, 1, 1, 1)
    assert adv("ms_grpo", rewards, group_ids, num_scales=1) == pytest.approx(adv("grpo", rewards, group_ids), rel=1e-12)


def test_ms_grpo_samples_subgroups_reproducibly_from_the_generator():
    # G = 8: scales {8, 6, 4, 2} with C(7, 5) = 21, C(7, 3) = 35, C(7, 1) = 7 subgroups per member. 4 per scale are
    # drawn from the generator; from 35 on, every subgroup is used and the generator no longer matters.
    rewards, group_ids = torch.linspace(0, 1, 8, dtype=F64) ** 2, torch.zeros(8, dtype=torch.long)

    def sampled(seed: int, draws: int = 4) -> list:
        generator = torch.Generator().manual_seed(seed)
        return adv("ms_grpo", rewards, group_ids, subgroups_per_scale=draws, generator=generator)

    assert sampled(0) == sampled(0)
    assert sampled(0) != sampled(1)
    assert sampled(0, draws=35) == pytest.approx(sampled(1, draws=35), rel=1e-12)
    assert adv("ms_grpo", torch.ones(8, dtype=F64), group_ids) == [0.0] * 8


def test_grpo_lead_worked_example():
    # w(x) = 0.4 + 1.1/(1 + e^{10(x − 0.75)}): w(0.25) = 0.4 + 1.1/(1 + e^−5) = 1.492638, w(0.75) = 0.4 + 0.55 = 0.95
    # hard group 0: correct [1,0,0,0], μ = 0.25, r = [1,−1,−1,−1]: mean −0.5, std √((2.25 + 3·0.25)/3) = 1
    #   Ã = [1.5, −0.5, −0.5, −0.5] -> positive × w(μ) = 1.5·1.492638 = 2.238957; negative × w(1−μ) = −0.5·0.95
    # easy group 1: correct [1,1,1,0], μ = 0.75, r = [1,1,1,−1]: Ã = [0.5, 0.5, 0.5, −1.5]
    #   positive × w(0.75) = 0.475; negative × w(1 − 0.75) = −1.5·1.492638 = −2.238957
    out = adv(
        "grpo_lead",
        t(1, -1, -1, -1, 1, 1, 1, -1),
        ids(0, 0, 0, 0, 1, 1, 1, 1),
        correctness=ids(1, 0, 0, 0, 1, 1, 1, 0),
        eps=0.0,
    )
    assert out == pytest.approx([2.238957, -0.475, -0.475, -0.475, 0.475, 0.475, 0.475, -2.238957], rel=1e-6)


def test_grpo_lead_evaluates_w_at_one_minus_mu():
    # Negative advantage on a hard prompt (μ = 0.25) is scaled by w(0.75) = 0.95, not 1 − w(0.25) = −0.492638 (which
    # would flip its sign): Ã = −0.5 -> −0.475.
    out = adv("grpo_lead", t(1, -1, -1, -1), ids(0, 0, 0, 0), correctness=ids(1, 0, 0, 0), eps=0.0)
    assert out[1] == pytest.approx(-0.475, rel=1e-12)


def test_tic_grpo_worked_example():
    # r/|o| = [1/2, 1/4, 0]: mean 1/4, std √((1/16 + 0 + 1/16)/2) = 1/4 -> A = [1, 0, −1]
    # (GRPO on r alone would give [0.577350, 0.577350, −1.154701]: the shorter correct answer is preferred)
    out = adv("tic_grpo", t(1, 1, 0), ids(0, 0, 0), lengths=ids(2, 4, 5), eps=0.0)
    assert out == pytest.approx([1.0, 0.0, -1.0], rel=1e-12, abs=1e-15)


def test_tic_grpo_length_correction_is_the_unverified_community_reading():
    # Spec §18/§24: TIC-GRPO's verified change is the trajectory ratio; the paper's advantage is GRPO's. The length
    # correction is the composer's reading: the docstring says so, and with equal lengths it reduces to GRPO.
    assert "UNVERIFIED" in ADVANTAGES.get("tic_grpo").__doc__
    rewards, group_ids = t(1, 0, 0, 1, 0.5), ids(0, 0, 0, 1, 1)
    same = adv("tic_grpo", rewards, group_ids, lengths=torch.full((5,), 7))
    assert same == pytest.approx(adv("grpo", rewards / 7, group_ids), rel=1e-12)
    # Unlike GRPO it gives an all-correct group non-zero advantages when lengths differ, favouring the shortest:
    # r/|o| = [1, 1/2, 1/4]: mean 7/12, deviations [5/12, −1/12, −1/3], std √((25 + 1 + 16)/144/2) = 0.381881
    out = adv("tic_grpo", t(1, 1, 1), ids(0, 0, 0), lengths=ids(1, 2, 4), eps=0.0)
    assert out == pytest.approx([1.091089, -0.218218, -0.872872], rel=1e-6)


def test_stratified_worked_example():
    # one group, strata [0, 0, 1, 1, 1], r = [1, 0, 1, 1, 0]
    #   stratum 0 {1, 0}: ±0.707107; stratum 1 {1, 1, 0}: mean 2/3, std √(1/3) -> 0.577350, 0.577350, −1.154701
    #   global (the group): mean 0.6, std √((3·0.16 + 2·0.36)/4) = √0.3 = 0.547723 -> 0.730297 (r=1), −1.095445 (r=0)
    #   α = 1: A = SAN; α = 0.5: (SAN + GN)/2 = [0.718702, −0.901276, 0.653823, 0.653823, −1.125073]
    rewards, strata = t(1, 0, 1, 1, 0), ids(0, 0, 1, 1, 1)
    san = adv("stratified", rewards, ids(0, 0, 0, 0, 0), strata=strata, eps=0.0)
    assert san == pytest.approx([0.707107, -0.707107, 0.577350, 0.577350, -1.154701], rel=1e-6)
    half = adv("stratified", rewards, ids(0, 0, 0, 0, 0), strata=strata, alpha=0.5, eps=0.0)
    assert half == pytest.approx([0.718702, -0.901276, 0.653823, 0.653823, -1.125073], rel=1e-6)


def test_stratified_strata_split_each_group_unless_per_group_is_false():
    # Two groups sharing stratum id 0: per group, group 1 = {1, 0} -> ±0.707107 and group 2 = {1, 1} -> 0.
    # Over the batch, stratum 0 = {1, 0, 1, 1}: mean 0.75, std 0.5 -> [0.5, −1.5, 0.5, 0.5].
    rewards, group_ids, strata = t(1, 0, 1, 1), ids(1, 1, 2, 2), ids(0, 0, 0, 0)
    assert adv("stratified", rewards, group_ids, strata=strata, eps=0.0) == pytest.approx(
        [0.707107, -0.707107, 0.0, 0.0], rel=1e-6
    )
    assert adv("stratified", rewards, group_ids, strata=strata, per_group=False, eps=0.0) == pytest.approx(
        [0.5, -1.5, 0.5, 0.5], rel=1e-12
    )


def test_rank_grpo_worked_example():
    # rank-shaped rewards s = [0.9, 0.2, 0.8, 0.1], correct [1, 1, 0, 0]: mean 0.5, s − mean = [0.4, −0.3, 0.3, −0.4]
    #   F = 1: correct -> max(A, 0): 0.4, 0 (was −0.3); incorrect -> min(A, 0): 0 (was 0.3), −0.4
    #   F = std = √((0.16 + 0.09 + 0.09 + 0.16)/3) = 0.408248: ±0.4/0.408248 = ±0.979796
    kwargs = dict(correctness=ids(1, 1, 0, 0))
    rewards, group_ids = t(0.9, 0.2, 0.8, 0.1), ids(0, 0, 0, 0)
    out = adv("rank_grpo", rewards, group_ids, scale_rewards=False, **kwargs)
    assert out == pytest.approx([0.4, 0.0, 0.0, -0.4], rel=1e-12)
    assert adv("rank_grpo", rewards, group_ids, eps=0.0, **kwargs) == pytest.approx(
        [0.979796, 0, 0, -0.979796], rel=1e-6
    )


def test_rank_grpo_defaults_keep_signs_consistent_with_correctness():
    # Spec §26.7: the composer's ξ⁻ = −0.5, ξ⁺ = +0.5 let a correct answer be pushed down (−0.3 above) and a wrong
    # one up (+0.3); the defaults ξ⁻ = ξ⁺ = 0 never do, on any rewards.
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, generator=generator, dtype=F64)
    correct = torch.rand(64, generator=generator) < 0.5
    group_ids = torch.arange(64) % 8
    out = ADVANTAGES.get("rank_grpo")(rewards, group_ids, correctness=correct)
    assert (out[correct] >= 0).all() and (out[~correct] <= 0).all()
    community = adv(
        "rank_grpo",
        t(0.9, 0.2, 0.8, 0.1),
        ids(0, 0, 0, 0),
        correctness=ids(1, 1, 0, 0),
        scale_rewards=False,
        correct_floor=-0.5,
        incorrect_ceiling=0.5,
    )
    assert community == pytest.approx([0.4, -0.3, 0.3, -0.4], rel=1e-12)


def test_xrpo_worked_example():
    # r = correct = [1, 1, 0, 0]: GRPO A = ±0.5/√(1/3) = ±0.866025
    # s = [−0.5, −1.5, −1, −1], mean −1: η = e^{0.5}, e^{−0.5}, 1, 1 = 1.648721, 0.606531, 1, 1
    # correct 0 (likely): max(1 − 1.648721, 0) = 0 -> no bonus; correct 1 (rare): min(0.393469, κA = 0.866025)
    #   -> A = 0.866025 + 0.393469 = 1.259494; incorrect unchanged
    kwargs = dict(correctness=ids(1, 1, 0, 0), mean_logp=t(-0.5, -1.5, -1, -1), eps=0.0)
    out = adv("xrpo", t(1, 1, 0, 0), ids(0, 0, 0, 0), **kwargs)
    assert out == pytest.approx([0.866025, 1.259494, -0.866025, -0.866025], rel=1e-6)
    # cap κ = 0.2: bonus min(0.393469, 0.2·0.866025 = 0.173205) -> 1.039230
    assert adv("xrpo", t(1, 1, 0, 0), ids(0, 0, 0, 0), novelty_cap=0.2, **kwargs)[1] == pytest.approx(
        1.039230, rel=1e-6
    )


GTPO_ENTROPY = t(3, 1, 4, 1, 1, 3, 1, 9, 2, 2, 2, 2).view(6, 2)
GTPO_MASK = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1]])


def gtpo_example(**kwargs) -> list:
    return adv(
        "gtpo",
        t(1, 0, 1, 0, 0, 1),
        ids(0, 9, 0, 9, 0, 9),
        entropy=GTPO_ENTROPY,
        mask=GTPO_MASK,
        correctness=ids(1, 0, 1, 0, 0, 1),
        eps=0.0,
        **kwargs,
    )


def test_gtpo_worked_example():
    # α1 = 1, α2 = 0.1. Group 0 (positions 0, 2, 4): correct, correct, wrong; H = [3, 1], [1, 3], [2, 2].
    #   O⁺ t=0: ΣH = 4, d = 2: 1 + 0.1·(3/4)·2 = 1.15, 1 + 0.1·(1/4)·2 = 1.05; t=1 mirrored: 1.05, 1.15
    #   O⁻ alone: −1 − 0.1·1·1 = −1.1 at both t
    #   the group's 6 tokens {1.15, 1.05, 1.05, 1.15, −1.1, −1.1}: mean 2.2/6 = 0.366667,
    #   std √(2·(0.783333² + 0.683333² + 1.466667²)/5) = 1.136955 -> 0.688975, 0.601021, −1.289995
    # Group 9 (positions 1, 3, 5): wrong H = [4, 1], wrong H = [1, pad], correct H = [2, 2].
    #   O⁻ t=0: 1/H = 0.25, 1 (Σ 1.25, h = 2): −1 − 0.1·0.2·2 = −1.04, −1 − 0.1·0.8·2 = −1.16
    #   O⁻ t=1: only position 1 active: −1 − 0.1·1·1 = −1.1; O⁺ alone: 1 + 0.1 = 1.1 at both t
    #   the group's 5 tokens {−1.04, −1.1, −1.16, 1.1, 1.1}: mean −0.22, std √(5.8152/4) = 1.205736
    #   -> −0.680082, −0.729845, −0.779607, 1.094767 (every correct token above every wrong one)
    expected = [
        [0.688975, 0.601021],
        [-0.680082, -0.729845],
        [0.601021, 0.688975],
        [-0.779607, 0.0],
        [-1.289995, -1.289995],
        [1.094767, 1.094767],
    ]
    for row, want in zip(gtpo_example(), expected, strict=True):
        assert row == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_gtpo_split_normalisation_is_the_ports_reading():
    # normalize="split" z-scores within O⁺ and O⁻ of each group (a third-party port's Eq. 6):
    #   group 0: O⁺ tokens {1.15, 1.05, 1.05, 1.15}: mean 1.1, std √(4·0.0025/3) = 0.057735 -> ±0.866025;
    #            O⁻ alone, constant -> 0
    #   group 9: O⁻ tokens {−1.04, −1.1, −1.16}: mean −1.1, std 0.06 -> [1, 0], [−1, (pad 0)]; O⁺ alone -> 0
    # so a correct token gets −0.866 and a wrong one +1: the signs the paper's Fig. 1 rules out.
    expected = [[0.866025, -0.866025], [1.0, 0.0], [-0.866025, 0.866025], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    for row, want in zip(gtpo_example(normalize="split"), expected, strict=True):
        assert row == pytest.approx(want, rel=1e-6, abs=1e-12)
    with pytest.raises(ValueError, match="normalize must be one of"):
        gtpo_example(normalize="set")


def test_entropy_at_padding_is_ignored():
    # GTPO/GRPO-S read H only where mask = 1; padding may hold anything, NaN included.
    entropy, mask = t(1, math.nan, 2, 3).view(2, 2), torch.tensor([[1, 0], [1, 1]])
    for name in ("gtpo", "grpo_s"):
        out = ADVANTAGES.get(name)(t(1, 0), ids(0, 0), entropy=entropy, mask=mask, correctness=ids(1, 0))
        assert torch.isfinite(out).all()


def test_grpo_s_worked_example():
    # mean entropies Ĥ = [3, 1, 0.5, 2] (the last over its one valid token); correct [1, 1, 0, 0]
    #   O⁺: Ĥ/ΣĤ·2 = 1.5, 0.5 -> 1 + 0.15 = 1.15, 1 + 0.05 = 1.05
    #   O⁻: 1/Ĥ = 2, 0.5 (Σ 2.5), ·2 = 1.6, 0.4 -> −1.16, −1.04
    #   group {1.15, 1.05, −1.16, −1.04}: mean 0, std √(4.8522/3) = 1.271770
    #   -> 0.904251, 0.825621, −0.912114, −0.817758 (correct > 0 > wrong)
    #   split (the port): O⁺ mean 1.1, std 0.070711 -> ±0.707107; O⁻ mean −1.1, std 0.084853 -> ∓0.707107
    entropy, mask = t(3, 3, 1, 1, 0.5, 0.5, 2, 9).view(4, 2), torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    kwargs = dict(entropy=entropy, mask=mask, correctness=ids(1, 1, 0, 0), eps=0.0)
    out = adv("grpo_s", t(1, 1, 0, 0), ids(0, 0, 0, 0), **kwargs)
    assert out == pytest.approx([0.904251, 0.825621, -0.912114, -0.817758], rel=1e-6)
    split = adv("grpo_s", t(1, 1, 0, 0), ids(0, 0, 0, 0), normalize="split", **kwargs)
    assert split == pytest.approx([0.707107, -0.707107, -0.707107, 0.707107], rel=1e-6)


# ------------------------------------------------------------------------------------------------ edge cases


def inputs(name: str, rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Rewards (as the estimator takes them) and deterministic extra inputs for a batch of per-sequence rewards."""
    batch = rewards.shape[0]
    ramp = torch.linspace(0.5, 2.0, batch, dtype=rewards.dtype)  # [B]
    correct = rewards > 0.5  # [B]
    extra = {
        "gdpo": {},
        "grpo_lead": {"correctness": correct},
        "rank_grpo": {"correctness": correct},
        "xrpo": {"correctness": correct, "mean_logp": -ramp},
        "tic_grpo": {"lengths": torch.arange(1, batch + 1)},
        "stratified": {"strata": torch.arange(batch) % 2},
        "pvpo": {"reference_value": torch.zeros_like(rewards)},
        "gtpo": {"entropy": ramp[:, None] * t(1, 2, 3), "mask": torch.ones(batch, 3), "correctness": correct},
        "grpo_s": {"entropy": ramp[:, None] * t(1, 2, 3), "mask": torch.ones(batch, 3), "correctness": correct},
    }.get(name, {})
    return (torch.stack([rewards, 1 - rewards], dim=1) if name == "gdpo" else rewards), extra


def run(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **overrides) -> torch.Tensor:
    rewards, extra = inputs(name, rewards, group_ids)
    return ADVANTAGES.get(name)(rewards, group_ids, **{**extra, **overrides})


@pytest.mark.parametrize("name", sorted(set(NAMES) - {"krpo", "pvpo"}))
def test_groups_of_one_get_zero(name):
    out = run(name, t(1, 0, 0.3, 1), ids(4, 8, 15, 16))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("name", sorted(set(NAMES) - {"krpo", "pvpo", "tic_grpo", "gtpo", "grpo_s"}))
def test_all_right_and_all_wrong_groups_get_zero(name):
    # krpo lags (see above), pvpo compares with a cached value, tic_grpo divides by unequal lengths and gtpo/grpo_s
    # redistribute by entropy inside a group, so those are non-zero by design on these groups.
    out = run(name, t(1, 0, 1, 0, 1, 0), ids(0, 1, 0, 1, 0, 1))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("name", NAMES)
def test_layout_and_ids_do_not_matter(name):
    # Groups a = positions 0-2 and b = 3-4, contiguous with ids 0/1, versus interleaved [b0, a0, b1, a1, a2]
    # (each group's own order kept, which KRPO depends on) with ids 1000 / −7.
    rewards, group_ids = t(1, 0, 0.5, 0.2, 0.9), ids(0, 0, 0, 1, 1)
    perm = torch.tensor([3, 0, 4, 1, 2])
    rewards_in, extra = inputs(name, rewards, group_ids)
    base = ADVANTAGES.get(name)(rewards_in, group_ids, **extra)
    moved = {key: value[perm] for key, value in extra.items()}
    out = ADVANTAGES.get(name)(rewards_in[perm], torch.where(group_ids[perm] == 0, 1000, -7), **moved)
    assert torch.allclose(out, base[perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_inputs_are_not_mutated_and_dtype_is_kept(name):
    rewards, group_ids = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9]), ids(0, 0, 0, 1, 1)
    rewards_in, extra = inputs(name, rewards, group_ids)
    before = [rewards_in.clone(), group_ids.clone(), *[v.clone() for v in extra.values()]]
    out = ADVANTAGES.get(name)(rewards_in, group_ids, **extra)
    for old, new in zip(before, [rewards_in, group_ids, *extra.values()], strict=True):
        assert torch.equal(old, new)
    assert out.dtype == torch.float32
    assert tuple(out.shape) == ((5, 3) if name == "gtpo" else (5,))
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_rewards_raise(name, bad):
    rewards, group_ids = t(1, 0, 1, 0), ids(0, 0, 1, 1)
    rewards_in, extra = inputs(name, rewards, group_ids)
    rewards_in = rewards_in.clone()
    rewards_in[1] = bad
    with pytest.raises(ValueError, match=rf"rewards must be finite, got {bad} at index"):
        ADVANTAGES.get(name)(rewards_in, group_ids, **extra)


@pytest.mark.parametrize("name", NAMES)
def test_shape_mismatch_names_expected_and_received(name):
    rewards_in, extra = inputs(name, t(1, 0, 1, 0), ids(0, 0, 1, 1))
    with pytest.raises(ValueError, match=r"group_ids must be \[B\] = \[4\], got \[3\]"):
        ADVANTAGES.get(name)(rewards_in, ids(0, 0, 1), **extra)
    with pytest.raises(ValueError, match=r"rewards must be \[B"):
        ADVANTAGES.get(name)(rewards_in[None], ids(0, 0, 1, 1), **extra)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_hyperparameter_is_a_type_error(name):
    rewards_in, extra = inputs(name, t(1, 0), ids(0, 0))
    with pytest.raises(TypeError):
        ADVANTAGES.get(name)(rewards_in, ids(0, 0), not_a_hyperparameter=1, **extra)


def test_extra_inputs_are_checked():
    rewards, group_ids = t(1, 0, 1), ids(0, 0, 0)
    with pytest.raises(ValueError, match=r"correctness must be \[B\] = \[3\], got \[2\]"):
        adv("rank_grpo", rewards, group_ids, correctness=ids(1, 0))
    with pytest.raises(ValueError, match="correctness must be bool or hold only 0 and 1"):
        adv("grpo_lead", rewards, group_ids, correctness=t(1, 0.5, 0))
    with pytest.raises(ValueError, match="lengths must be positive"):
        adv("tic_grpo", rewards, group_ids, lengths=ids(3, 0, 2))
    with pytest.raises(ValueError, match="mean_logp must be finite"):
        adv("xrpo", rewards, group_ids, correctness=ids(1, 0, 1), mean_logp=t(-1, math.nan, -1))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] = \[3, 2\], got \[3, 1\]"):
        adv("gtpo", rewards, group_ids, entropy=torch.ones(3, 2), mask=torch.ones(3, 1), correctness=ids(1, 0, 1))
    with pytest.raises(ValueError, match="entropy must be finite"):
        adv(
            "grpo_s",
            rewards,
            group_ids,
            entropy=t(1, math.inf, 1).view(3, 1),
            mask=torch.ones(3, 1),
            correctness=ids(1, 0, 1),
        )
    with pytest.raises(ValueError, match=r"weights must be \[K\] = \[2\], got \[3\]"):
        adv("gdpo", t(1, 0, 1, 0).view(2, 2), ids(0, 0), weights=[1.0, 1.0, 1.0])
    with pytest.raises(TypeError, match="group_ids must be an integer tensor"):
        adv("grpo", rewards, t(0, 0, 0))
    with pytest.raises(TypeError, match="strata must be an integer tensor"):
        adv("stratified", rewards, group_ids, strata=t(0, 1, 1))
    with pytest.raises(TypeError, match="rewards must be a floating-point tensor"):
        adv("grpo", ids(1, 0, 1), group_ids)

"""Rewards: a hand-worked example per registered reward, edge cases, input checks and the registry.

Expected numbers are derived in the comments from each paper's formula (spec/variants.md section given) and held
as literals; no test re-implements a reward. The spec §26 tests put the paper's value next to grpo-composer's.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.groups import group_index, group_rank
from grpo_kernels.rewards import (
    REWARDS,
    DiversityReward,
    MultiReward,
    WeightedSum,
    countdown,
    dapo_overlong,
    format_reward,
    gapo_frequency,
    grpo_lead_length,
    gsm8k,
    math_answer,
    p_grpo_posterior,
    rank_grpo,
    spo_trajectory,
    unlikeliness,
)

NAN, INF = float("nan"), float("inf")


def assert_rewards(actual: torch.Tensor, expected: list[float]) -> None:
    """A float32 [B] tensor equal to the literals (float32 rounding)."""
    assert actual.dtype == torch.float32 and actual.shape == (len(expected),), (actual.dtype, actual.shape)
    # torch.allclose, not torch.testing.assert_close: the latter imports torch.distributed (~0.7 s) on first use
    target = torch.tensor(expected, dtype=torch.float32)
    assert torch.allclose(actual, target, rtol=1e-6, atol=1e-6), (actual.tolist(), expected)


# ---------------------------------------------------------------- registry


def test_registry_lists_every_reward_with_its_paper():
    assert REWARDS.names() == [
        "countdown",
        "dapo_overlong",
        "dra_diversity",
        "format",
        "gapo_frequency",
        "gdpo_multi",
        "grpo_lead_length",
        "gsm8k",
        "math_answer",
        "p_grpo_posterior",
        "rank_grpo",
        "spo_trajectory",
        "unlikeliness",
        "weighted_sum",
    ]
    for component in REWARDS:
        assert "arXiv:" in component.paper, component.name
        assert component.summary, component.name
    assert REWARDS.get("gsm8k") is gsm8k and REWARDS.get("dra_diversity") is DiversityReward


def test_unknown_reward_lists_the_valid_choices():
    with pytest.raises(ValueError, match="unknown reward 'gspo_len'") as error:
        REWARDS.get("gspo_len")
    for name in REWARDS.names():
        assert repr(name) in str(error.value)


# ---------------------------------------------------------------- text rewards


def test_gsm8k_worked_example():
    completions = [
        "<think>600 + 634</think><answer>1,234</answer>",  # commas stripped: 1234 == 1234            -> 1
        "So she pays $1,000,000 in total.",  # no tag: last number 1000000                            -> 1
        "The temperature falls to -5 degrees.",  # negative number                                   -> 1
        "<answer>72.0</answer>",  # exact decimal comparison: 72.0 == 72                              -> 1
        "10 - 2 = 8, so 7",  # last number is 7, not 8                                                -> 0
        "10-2",  # '-' after a digit is subtraction: last number 2, not -2                             -> 0
        "<answer>none</answer> 5",  # the tag wins and holds no number                                 -> 0
        "<answer>5",  # unclosed tag: no tag, last number 5                                            -> 1
        "",  # empty completion                                                                         -> 0
    ]
    answers = ["#### 1234", "#### 1,000,000", "#### -5", "#### 72", "#### 8", "#### -2", "#### 5", "5", "#### 3"]
    assert_rewards(gsm8k(completions, answers=answers, unused_column=[0] * 9), [1, 1, 1, 1, 0, 0, 0, 1, 0])


def test_gsm8k_unparseable_ground_truth_names_the_entry():
    with pytest.raises(ValueError, match=r"answers\[1\]"):
        gsm8k(["1", "2"], answers=["#### 1", "#### two"])


COUNTDOWN = [
    # (completion, numbers, target, reward)
    ("<think>3*5=15, +7</think><answer>3 * 5 + 7</answer>", [3, 5, 7], 22, 1.0),  # 15 + 7 = 22
    ("<answer>(7 - 5) * 3</answer>", [3, 5, 7], 6, 1.0),  # 2 * 3 = 6
    ("<answer>6 / (1 - 3 / 4)</answer>", [1, 3, 4, 6], 24, 1.0),  # exact fractions: 6 / (1/4) = 24
    ("<answer>3 × 5 + 7</answer>", [7, 5, 3], 22, 1.0),  # Unicode ×; numbers in any order
    ("<answer>3 * 5 + 7</answer>", [3, 5, 7], 22.0000005, 1.0),  # |22 − 22.0000005| = 5e-7 <= 1e-6
    ("<answer>3 * 5 + 7</answer>", [3, 5, 7], 22.000002, 0.0),  # 2e-6 > 1e-6
    ("<answer>3 * 5 + 7 + 3 - 3</answer>", [3, 5, 7], 22, 0.0),  # 3 reused
    ("<answer>15 + 7</answer>", [3, 5, 7], 22, 0.0),  # 15 was not given
    ("<answer>3 * 7</answer>", [3, 5, 7], 21, 0.0),  # 5 left out
    ("<answer>3 / (5 - 5)</answer>", [3, 5, 5], 0, 0.0),  # division by zero scores 0, no exception
    ("<answer>-3 + 5</answer>", [3, 5], 2, 0.0),  # unary minus is not one of the four operations
    ("<answer>3 ** 2</answer>", [3, 2], 9, 0.0),  # power
    ("<answer>3 * 5 + 7 = 22</answer>", [3, 5, 7], 22, 0.0),  # '=' is not part of an expression
    ("<answer>__import__('os').getcwd()</answer>", [3], 3, 0.0),  # code, never evaluated
    ("<answer>(lambda: 3)()</answer>", [3], 3, 0.0),
    ("<answer>3.0 * 1</answer>", [3, 1], 3, 0.0),  # float literal
    ("<answer>3 * (5 + 7</answer>", [3, 5, 7], 36, 0.0),  # malformed expression
    ("3 * 5 + 7", [3, 5, 7], 22, 0.0),  # no answer tag
    ("<answer></answer>", [3], 3, 0.0),  # empty answer
    ("", [3], 3, 0.0),  # empty completion
    ("<answer>" + "+".join(["1"] * 3000) + "</answer>", [1] * 3000, 3000, 0.0),  # too deep: 0, no crash
]


def test_countdown_worked_examples_and_edge_cases():
    completions, numbers, targets, expected = zip(*COUNTDOWN, strict=True)
    assert_rewards(countdown(list(completions), targets=list(targets), numbers=list(numbers)), list(expected))


def test_countdown_accepts_tensors():
    out = countdown(
        ["<answer>(3 + 5) * 2</answer>"] * 2, targets=torch.tensor([16, 15]), numbers=torch.tensor([[3, 5, 2]] * 2)
    )
    assert_rewards(out, [1.0, 0.0])  # (3 + 5) * 2 = 16


def test_format_reward_is_strict_and_whole_string():
    completions = [
        "<think>a</think><answer>b</answer>",  # 1
        "<think>\nreason\n</think>\n<answer>\n42\n</answer>",  # newlines inside and between: 1
        "",  # 0
        "x<think>a</think><answer>b</answer>",  # text before: 0
        "<think>a</think><answer>b</answer> x",  # text after: 0
        "<think>a</think><answer>b</answer><answer>c</answer>",  # second answer: 0
        "<think>a<think>b</think><answer>c</answer>",  # nested think: 0
        "<think>a</think><answer>b",  # unclosed: 0
        "<answer>b</answer><think>a</think>",  # wrong order: 0
        "<think>a</think>text<answer>b</answer>",  # only whitespace may separate the blocks: 0
    ]
    assert_rewards(format_reward(completions, answers=["ignored"] * 10), [1, 1, 0, 0, 0, 0, 0, 0, 0, 0])


def test_text_rewards_check_their_inputs():
    with pytest.raises(ValueError, match="answers must have one entry per completion"):
        gsm8k(["a", "b"], answers=["#### 1"])
    with pytest.raises(ValueError, match="targets"):
        countdown(["a"], targets=[1, 2], numbers=[[1]])
    with pytest.raises(ValueError, match="numbers must have one entry"):
        countdown(["a"], targets=[1], numbers=[[1], [2]])
    with pytest.raises(ValueError, match="targets must be finite"):
        countdown(["a"], targets=[NAN], numbers=[[1]])
    with pytest.raises(TypeError, match=r"numbers\[0\] must hold integers"):
        countdown(["a"], targets=[1], numbers=[[1.5]])
    with pytest.raises(TypeError, match="completions must be a list of str"):
        format_reward("<think>a</think><answer>b</answer>")
    with pytest.raises(TypeError, match=r"completions\[1\] must be a str"):
        format_reward(["a", None])


# ---------------------------------------------------------------- math-verify


def test_math_answer_worked_example():
    pytest.importorskip("math_verify")
    completions = [
        "<think>half</think><answer>\\frac{1}{2}</answer>",  # 1/2 == 0.5                              -> 1
        "The answer is \\boxed{\\frac12}.",  # boxed, gold written with $...$                           -> 1
        "<answer>so the result is \\boxed{3}</answer>",  # boxed inside the tag                          -> 1
        "\\boxed{4}",  # 4 != 3                                                                          -> 0
        "the answer is 3",  # neither boxed nor tagged                                                   -> 0
        "\\boxed{\\frac{1}{2",  # unbalanced braces                                                     -> 0
        "",  # empty                                                                                     -> 0
    ]
    answers = ["0.5", "$\\frac{1}{2}$", "3", "3", "3", "\\frac{1}{2}", "1"]
    assert_rewards(math_answer(completions, answers=answers), [1, 1, 1, 0, 0, 0, 0])


def test_math_answer_checks_its_inputs():
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="answers must have one entry per completion"):
        math_answer(["\\boxed{1}"], answers=[])
    with pytest.raises(ValueError, match=r"answers\[0\]"):
        math_answer(["\\boxed{1}"], answers=[""])


def test_math_answer_runs_in_worker_threads():
    pytest.importorskip("math_verify")
    with ThreadPoolExecutor(max_workers=1) as pool:  # math-verify's signal.alarm timeouts need the main thread
        out = pool.submit(math_answer, ["\\boxed{2}", "\\boxed{3}"], answers=["2", "2"]).result()
    assert_rewards(out, [1.0, 0.0])


def test_math_answer_without_math_verify_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'grpo-kernels\[math\]'"):
        math_answer(["\\boxed{1}"], answers=["1"])


# ---------------------------------------------------------------- combinations


def test_gdpo_multi_keeps_columns_and_weighted_sum_combines_them():
    completions = [
        "<think>t</think><answer>72</answer>",  # gsm8k 1, format 1
        "<think>t</think><answer>71</answer>",  # gsm8k 0, format 1
        "the answer is 72",  # gsm8k 1, format 0
    ]
    answers = ["#### 72"] * 3
    matrix = MultiReward([gsm8k, format_reward], weights=[1.0, 0.5])(completions, answers=answers)
    assert matrix.dtype == torch.float32
    assert torch.equal(matrix, torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]))
    # 1·gsm8k + 0.5·format: [1 + 0.5, 0 + 0.5, 1 + 0]
    assert_rewards(WeightedSum([(gsm8k, 1.0), (format_reward, 0.5)])(completions, answers=answers), [1.5, 0.5, 1.0])


def test_combinations_check_components():
    bad_shape = lambda completions, **kwargs: torch.zeros(len(completions) + 1)
    with pytest.raises(ValueError, match="must return a tensor"):
        MultiReward([bad_shape])(["a"])
    nan_reward = lambda completions, **kwargs: torch.full((len(completions),), NAN)
    with pytest.raises(ValueError, match="must be finite"):
        WeightedSum([(nan_reward, 1.0)])(["a"])
    with pytest.raises(ValueError, match="weights must be finite"):
        MultiReward([format_reward], weights=[NAN])
    with pytest.raises(ValueError, match="weights must have one entry per reward"):
        MultiReward([format_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="terms"):
        WeightedSum([])


# ---------------------------------------------------------------- GAPO (spec §3)

# Group 0, L = |V| = 4, V = {A, B, C, D}; keys A A A A B B C X (X invalid): n_valid = 7,
# f_A = 4/7, f_B = 2/7, f_C = 1/7, 1/L = 1/4 = 7/28.
#   R_A = 1 − (16/28 − 7/28) = 19/28 = 0.678571;  R_B = 1 − (8/28 − 7/28) = 27/28 = 0.964286
#   R_C = 1 − (4/28 − 7/28) = 31/28 = 1.107143;   R_X = −1
# Group 1 (one completion), V = {A, B}: f = 1, R = 1 − (1 − 1/2) = 0.5.   Group 2: all invalid -> −1, −1.
V4, V2 = {"A", "B", "C", "D"}, {"A", "B"}
GAPO_KEYS = ["A", "A", "B", "A", "Q", "C", "B", "A", "X", "Y", "Z"]
GAPO_VALID = [V4, V4, V4, V4, V2, V4, V4, V4, V4, V4, V4]
GAPO_GROUPS = ["g0", "g0", "g0", "g0", "g1", "g0", "g0", "g0", "g0", "g2", "g2"]


def test_gapo_frequency_worked_example():
    keys, valid = GAPO_KEYS[:], GAPO_VALID[:]
    keys[4] = "A"  # group 1's single completion is valid
    R_A, R_B, R_C = 19 / 28, 27 / 28, 31 / 28
    expected = [R_A, R_A, R_B, R_A, 0.5, R_C, R_B, R_A, -1.0, -1.0, -1.0]
    assert_rewards(gapo_frequency(keys, valid, GAPO_GROUPS), expected)


def test_gapo_rewards_rare_valid_answers_unlike_composer_abs():
    """Spec §26 item 4: the paper's 1 − (f − 1/L) rewards under-represented answers above the uniform share;
    grpo-composer's 1 − |f − 1/L| = 1 − 3/28 = 25/28 = 0.892857 puts the rare C *below* B (27/28)."""
    out = gapo_frequency(GAPO_KEYS, GAPO_VALID, GAPO_GROUPS)
    r_b, r_c = out[2].item(), out[5].item()
    assert r_c == pytest.approx(31 / 28) and r_c > r_b  # paper: rarer valid answer earns more
    composer_c = 25 / 28
    assert composer_c < r_b < r_c


def test_gapo_checks_its_inputs():
    with pytest.raises(ValueError, match="valid_answers must have one entry"):
        gapo_frequency(["A"], [V2, V2], [0])
    with pytest.raises(ValueError, match="group_ids must have one entry"):
        gapo_frequency(["A"], [V2], [0, 1])
    with pytest.raises(ValueError, match=r"valid_answers\[0\] must be a non-empty"):
        gapo_frequency(["A"], [set()], [0])


# ---------------------------------------------------------------- DRA-GRPO (spec §5)

# Group 0 (non-contiguous: a, b, c): e_a = (1, 0), e_b = (3, 4), e_c = (0, 2) -> unit (1,0), (.6,.8), (0,1)
#   s_ab = 0.6, s_ac = 0, s_bc = 0.8 -> SMI = [0.6, 1.4, 0.8]
#   r = 1 each: r̃ = [1/1.6, 1/2.4, 1/1.8] = [0.625, 0.416667, 0.555556]
# Group 1: d = (1, 0) alone (same direction as a, other group: not counted) -> SMI 0, r̃ = 1
# Group 2: e = (1, 0), f = (−1, 0): cos = −1, clamped to 0 -> SMI 0, r̃ = r = [1, 0.5]
EMBEDDINGS = {"a": (1.0, 0.0), "d": (1.0, 0.0), "b": (3.0, 4.0), "e": (1.0, 0.0), "c": (0.0, 2.0), "f": (-1.0, 0.0)}
DRA_TEXTS, DRA_GROUPS = ["a", "d", "b", "e", "c", "f"], [0, 1, 0, 2, 0, 2]


def embed(texts: list[str]) -> torch.Tensor:
    return torch.tensor([EMBEDDINGS[t] for t in texts])


def test_dra_diversity_worked_example():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    out = DiversityReward(embed)(DRA_TEXTS, rewards, torch.tensor(DRA_GROUPS))
    assert_rewards(out, [0.625, 1.0, 1 / 2.4, 1.0, 1 / 1.8, 0.5])
    assert rewards.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5]  # input untouched


def test_dra_divides_unlike_composer_multiply():
    """Spec §26 item 3: paper r/(1 + SMI) stays positive; composer's r·(1 − SMI) = 1·(1 − 1.4) = −0.4 turns
    completion b, a correct answer, into a penalty."""
    out = DiversityReward(embed)(["a", "b", "c"], [1.0, 1.0, 1.0], [0, 0, 0])
    composer = [1 * (1 - 0.6), 1 * (1 - 1.4), 1 * (1 - 0.8)]  # [0.4, −0.4, 0.2]
    assert (out > 0).all() and composer[1] < 0
    assert out[1].item() == pytest.approx(1 / 2.4)


def test_dra_checks_its_inputs():
    reward = DiversityReward(embed)
    with pytest.raises(ValueError, match="rewards must be finite"):
        reward(["a", "b"], [1.0, NAN], [0, 0])
    with pytest.raises(ValueError, match=r"embed\(completions\) must be finite"):
        DiversityReward(lambda texts: torch.full((len(texts), 2), NAN))(["a"], [1.0], [0])
    with pytest.raises(ValueError, match=r"embed\(completions\) must return a tensor \[B, d\]"):
        DiversityReward(lambda texts: torch.ones(len(texts)))(["a"], [1.0], [0])
    with pytest.raises(ValueError, match="group_ids must have one entry"):
        reward(["a", "b"], [1.0, 1.0], [0])
    with pytest.raises(TypeError, match="embed must be a callable"):
        DiversityReward("jina")


# ---------------------------------------------------------------- GRPO-LEAD (spec §10)


def test_grpo_lead_length_worked_example():
    # Group 0: lengths 100, 200, 300 correct, 400 wrong. mean_c = 200, unbiased std_c = sqrt((100² + 0 + 100²)/2)
    #   = 100 -> z = −1, 0, 1 -> exp(∓0.05·z): exp(0.05) = 1.051271, 1, exp(−0.05) = 0.951229; wrong -> −1
    # Group 1: one correct -> std_c = 1, z = 0 -> 1.      Group 2: all wrong -> −1, −1.
    # Group 3: both correct, 100 and 300: mean 200, std = sqrt(2·100²/1) = 141.421 -> z = ∓0.707107
    #   -> exp(±0.05·0.707107) = 1.035988, 0.965262
    lengths = [100, 200, 300, 400, 500, 50, 60, 100, 300]
    correct = [True, True, True, False, True, False, False, True, True]
    groups = [0, 0, 0, 0, 1, 2, 2, 3, 3]
    expected = [1.0512711, 1.0, 0.9512294, -1.0, 1.0, -1.0, -1.0, 1.0359878, 0.9652624]
    assert_rewards(grpo_lead_length(lengths, correct, groups), expected)
    # The released config's incorrect_reward = 0 instead of the paper's −1:
    out = grpo_lead_length(torch.tensor(lengths[:4]), torch.tensor(correct[:4]), [0] * 4, incorrect_reward=0.0)
    assert_rewards(out, [1.0512711, 1.0, 0.9512294, 0.0])


def test_grpo_lead_checks_its_inputs():
    with pytest.raises(ValueError, match="lengths must be finite"):
        grpo_lead_length([1.0, NAN], [True, True], [0, 0])
    with pytest.raises(ValueError, match="correct must be bool or hold only 0 and 1"):
        grpo_lead_length([1.0, 2.0], [1, 2], [0, 0])
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        grpo_lead_length([-1.0], [True], [0])


# ---------------------------------------------------------------- DAPO overlong (spec §6)


def test_dapo_overlong_worked_example():
    # L_max = 20480, L_cache = 4096 -> free up to 16384; (16384 − |y|)/4096 in (16384, 20480]; −1 beyond
    #   17408 -> −1024/4096 = −0.25;  18432 -> −0.5;  20480 -> −1;  20481, 30000 -> −1
    lengths = torch.tensor([0, 16384, 17408, 18432, 20480, 20481, 30000])
    assert_rewards(dapo_overlong(lengths), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    # L_max = 10, L_cache = 4 -> free up to 6: 7 -> −1/4, 10 -> −1, 11 -> −1
    assert_rewards(dapo_overlong([6, 7, 10, 11], max_completion_len=10, soft_punish_cache=4), [0.0, -0.25, -1.0, -1.0])


def test_dapo_overlong_checks_its_inputs():
    with pytest.raises(ValueError, match="lengths must be finite"):
        dapo_overlong([1.0, INF])
    with pytest.raises(ValueError, match="soft_punish_cache"):
        dapo_overlong([1], max_completion_len=10, soft_punish_cache=20)


# ---------------------------------------------------------------- P-GRPO (spec §12)


def test_p_grpo_posterior_worked_example():
    # R = R_format + R_outcome + R_outcome·R_think
    #   (1, 1, 0.8) -> 2.8;  (1, 0, 0.9) -> 1 (the thinking score of a failed outcome is not paid)
    #   (0, 1, 0.5) -> 1.5;  (1, 0, 0.0) -> 1
    out = p_grpo_posterior([1.0, 1.0, 0.0, 1.0], [1, 0, 1, 0], [0.8, 0.9, 0.5, 0.0])
    assert_rewards(out, [2.8, 1.0, 1.5, 1.0])


def test_p_grpo_checks_its_inputs():
    with pytest.raises(ValueError, match="think_rewards must be in"):
        p_grpo_posterior([1.0], [1], [1.5])
    with pytest.raises(ValueError, match="outcome_rewards must be bool or hold only 0 and 1"):
        p_grpo_posterior([1.0], [0.5], [0.5])
    with pytest.raises(ValueError, match="format_rewards must be finite"):
        p_grpo_posterior([NAN], [1], [0.5])
    with pytest.raises(ValueError, match="think_rewards must be"):
        p_grpo_posterior([1.0, 1.0], [1, 1], [0.5])


# ---------------------------------------------------------------- RankGRPO (spec §14)

# Group 0 (G = 4): s = [1, 0, 1, 0], ranks k = [1, 2, 3, 4], τ = 0.1
#   weight:     s·exp(τ(1 − k)) = [1, 0, exp(−0.2) = 0.818731, 0]
#   supplement: s + τ·tanh(4/k − 1) = [1 + 0.1·tanh 3, 0.1·tanh 1, 1 + 0.1·tanh(1/3), 0.1·tanh 0]
#               = [1.099505, 0.076159, 1.032151, 0]
#   reward:     (4 − k)/3 = [1, 0.666667, 0.333333, 0]   (correctness-blind: the wrong k=2 beats the right k=3)
# Group 1 (G = 2): s = [1, 1], k = [2, 1]: weight [exp(−0.1) = 0.904837, 1]; supplement [1 + 0, 1 + 0.1·tanh 1];
#   reward [0, 1].   Group 2 (G = 1): s = [0], k = [1]: weight 0, supplement 0.1·tanh 0 = 0, reward 1.
RANK_S, RANK_K, RANK_G = [1, 0, 1, 0, 1, 1, 0], [1, 2, 3, 4, 2, 1, 1], [0, 0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("weight", [1.0, 0.0, 0.8187308, 0.0, 0.9048374, 1.0, 0.0]),
        ("supplement", [1.0995055, 0.0761594, 1.0321513, 0.0, 1.0, 1.0761594, 0.0]),
        ("reward", [1.0, 2 / 3, 1 / 3, 0.0, 0.0, 1.0, 1.0]),
    ],
)
def test_rank_grpo_worked_example(mode, expected):
    assert_rewards(rank_grpo(RANK_S, RANK_K, RANK_G, mode=mode), expected)


def test_rank_grpo_signs_follow_correctness_unlike_composer_defaults():
    """Spec §26 item 7, through the RankGRPO advantage (advantages package, F_norm = 1). All-correct group,
    weight mode, k = 1, 2, 3: s = [1, 0.904837, 0.818731], mean 0.907856, A = s − mean = [0.092144, −0.003019,
    −0.089125]. The clip max(A, ξ⁻) with the default ξ⁻ = 0 gives [0.092144, 0, 0]: no correct answer is pushed
    down. grpo-composer's ξ⁻ = −0.5 leaves max(−0.089125, −0.5) = −0.089125: a correct answer pushed down."""
    s = rank_grpo([1, 1, 1], [1, 2, 3], [0, 0, 0])
    assert_rewards(s, [1.0, 0.9048374, 0.8187308])
    advantage = ADVANTAGES.get("rank_grpo")
    group, correct = torch.tensor([0, 0, 0]), torch.tensor([True, True, True])
    paper = advantage(s, group, correctness=correct, scale_rewards=False)
    composer = advantage(s, group, correctness=correct, scale_rewards=False, correct_floor=-0.5, incorrect_ceiling=0.5)
    assert_rewards(paper, [0.0921439, 0.0, 0.0])
    assert_rewards(composer, [0.0921439, -0.0030186, -0.0891253])
    # Reward level: a wrong answer ranked above right ones (k = 2 between k = 1 and 3) still scores below them in
    # weight and supplement modes, and supplement's τ is capped at 1 so its bonus can never close the gap.
    for mode in ("weight", "supplement"):
        out = rank_grpo([1, 0, 1], [1, 2, 3], [0, 0, 0], mode=mode)
        assert out[1] < out[2] < out[0], mode


def test_rank_grpo_checks_its_inputs():
    with pytest.raises(ValueError, match="ranks must be integers in 1..G"):
        rank_grpo([1, 0], [1, 3], [0, 0])
    with pytest.raises(ValueError, match="mode must be one of"):
        rank_grpo([1], [1], [0], mode="listwise")
    with pytest.raises(ValueError, match="tau must be"):
        rank_grpo([1], [1], [0], mode="supplement", tau=2.0)
    with pytest.raises(ValueError, match="rewards must be bool or hold only 0 and 1"):
        rank_grpo([0.5], [1], [0])


# ---------------------------------------------------------------- Rewarding the Unlikely (spec §15)


def test_unlikeliness_worked_example():
    # Group 0 (G = 4): mean old log-probs [−0.5, −2.0, −1.0, −0.1] -> ascending ranks [2, 0, 1, 3];
    #   r·(1 − 0.25·rank/4): [1·(1 − 0.125), 1·1, 0 (wrong stays 0), 1·(1 − 0.1875)] = [0.875, 1, 0, 0.8125]
    # Group 1 (G = 1): rank 0 -> unchanged 1.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    old_logp = torch.tensor([-0.5, -2.0, -1.0, -0.1, -3.0])
    out = unlikeliness(rewards, old_logp, ["q0", "q0", "q0", "q0", "q1"])
    assert_rewards(out, [0.875, 1.0, 0.0, 0.8125, 1.0])
    assert rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]  # input untouched


def test_unlikeliness_masked_token_logps_and_ties():
    # Masked means: [(−1 − 3)/2, (−2 − 2 − 2)/3] = [−2, −2]; the padding NaN never counts. Tie -> batch order:
    # ranks [0, 1], G = 2 -> [1·(1 − 0), 1·(1 − 0.25·1/2)] = [1, 0.875]
    old_logp = torch.tensor([[-1.0, -3.0, NAN], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert_rewards(unlikeliness([1.0, 1.0], old_logp, [7, 7], mask=mask), [1.0, 0.875])


def test_unlikeliness_checks_its_inputs():
    with pytest.raises(ValueError, match="old_logp must be finite"):
        unlikeliness([1.0, 1.0], torch.tensor([[-1.0, NAN], [-1.0, -1.0]]), [0, 0])
    with pytest.raises(ValueError, match="rewards must be finite"):
        unlikeliness([1.0, INF], torch.tensor([-1.0, -1.0]), [0, 0])
    with pytest.raises(ValueError, match="mask must be"):
        unlikeliness([1.0], torch.zeros(1, 3), [0], mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="rewards must be"):
        unlikeliness([1.0, 1.0, 1.0], [-1.0, -2.0], [0, 0])


# ---------------------------------------------------------------- SPO (spec §16)


def test_spo_trajectory_worked_example():
    # correct -> 1; wrong -> σ(5·(RTS − 0.5)): RTS 0.8 -> σ(1.5) = 0.817574, 0.5 -> 0.5, 0.2 -> σ(−1.5) = 0.182426
    out = spo_trajectory([True, False, False, False], [1.0, 0.8, 0.5, 0.2])
    assert_rewards(out, [1.0, 0.8175745, 0.5, 0.1824255])


def test_spo_reward_increases_with_correct_reasoning_unlike_composer():
    """Spec §26 item 6: in an all-wrong group the paper's reward rises with RTS; grpo-composer's
    1/(1 + exp(+5(RTS − 0.5))) gives RTS 0.2 -> 0.817574 and RTS 0.8 -> 0.182426, the reverse."""
    out = spo_trajectory(torch.zeros(3, dtype=torch.bool), torch.tensor([0.2, 0.5, 0.8]))
    assert (out.diff() > 0).all() and (out < 1).all()
    composer = [0.8175745, 0.5, 0.1824255]
    assert_rewards(out, composer[::-1])


def test_spo_checks_its_inputs():
    with pytest.raises(ValueError, match="rts must be finite"):
        spo_trajectory([False], [NAN])
    with pytest.raises(ValueError, match="rts must be in"):
        spo_trajectory([False], [1.5])
    with pytest.raises(ValueError, match="beta must be > 0"):
        spo_trajectory([False], [0.5], beta=-5.0)
    with pytest.raises(ValueError, match="rts must have|rts must be \\[B\\]"):
        spo_trajectory([False, True], [0.5])


# ---------------------------------------------------------------- groups


def test_group_helpers_handle_unordered_unequal_groups():
    index = group_index(["b", "a", "b", "c", "a", "b"], 6)
    assert index.tolist() == [0, 1, 0, 2, 1, 0]  # numbered by first appearance
    # values within group b (positions 0, 2, 5): 3, 1, 2 -> ranks 2, 0, 1; group a (1, 4): 5, 5 -> tie, 0, 1
    rank = group_rank(torch.tensor([3.0, 5.0, 1.0, 9.0, 5.0, 2.0]), index)
    assert rank.tolist() == [2, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        group_index(torch.tensor([0.0, 1.0]), 2)

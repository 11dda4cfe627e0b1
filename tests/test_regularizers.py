"""Regularizers and learned weights: a hand-worked example per registry entry, gradients, edge cases, checks.

Expected values are literals derived in the comments from each paper's formula (spec/variants.md §7, §8, §19,
§21, §22). The learnable modules (DARO, λ-GRPO) are also held to float64 `gradcheck` through their parameters.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from grpo_kernels.regularizers import (
    REGULARIZERS,
    AMIRLambda,
    DAROWeights,
    LambdaGRPOWeights,
    amir_pairs,
    amir_preference,
    daro_bin_losses,
    info_grpo,
    tr_grpo_weights,
)

F64 = torch.float64


def t(values, dtype=F64, requires_grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=requires_grad)


def ids(values):
    return torch.tensor(values, dtype=torch.long)


# ------------------------------------------------------------------------------------------------- AMIR-GRPO
def test_amir_pairs_all_topk_and_cap():
    # group 4 = rewards 3.0, 1.2, 0.0 at positions 1, 3, 4; margin 1.0:
    #   all:  (1,3) gap 1.8 ✓, (1,4) gap 3.0 ✓, (3,4) gap 1.2 ✓      topk (best = 1): (1,3), (1,4)
    #   cap 1 keeps the largest gap: (1,4)
    # group 2 = rewards 2.0, 2.0 (gap 0: no pair); group 7 = one response (no pair)
    rewards, groups = t([2.0, 3.0, 2.0, 1.2, 0.0, 5.0]), ids([2, 4, 2, 4, 4, 7])
    chosen, rejected = amir_pairs(rewards, groups, margin=1.0)
    assert sorted(zip(chosen.tolist(), rejected.tolist(), strict=True)) == [(1, 3), (1, 4), (3, 4)]
    chosen, rejected = amir_pairs(rewards, groups, margin=1.0, pair_mining="topk")
    assert sorted(zip(chosen.tolist(), rejected.tolist(), strict=True)) == [(1, 3), (1, 4)]
    chosen, rejected = amir_pairs(rewards, groups, margin=1.0, max_pairs_per_group=1)
    assert (chosen.tolist(), rejected.tolist()) == ([1], [4])


def test_amir_preference_worked_example():
    # one group of 3, rewards 2.0, 0.0, 0.25, δ = 1.5: pairs (0,1) gap 2.0 ✓ and (0,2) gap 1.75 ✓; (2,1) gap 0.25 ✗
    # logp_sum = −10, −12, −11; ref = −10.5, −11, −11 -> implicit ℓ − ℓ^ref = 0.5, −1.0, 0.0
    # z01 = 0.2·(0.5 − (−1)) = 0.3, z02 = 0.2·(0.5 − 0) = 0.1
    # −log σ(0.3) = ln(1 + e^−0.3) = 0.554355244, −log σ(0.1) = ln(1 + e^−0.1) = 0.644396660; mean 0.599375952
    # loss = λ·mean = 0.01 · 0.599375952 = 0.00599375952
    # d/dlogp: d(−log σ(z))/dz = −σ(−z), σ(−0.3) = 0.425557483, σ(−0.1) = 0.475020813; λβ/K = 0.01·0.2/2 = 0.001
    #   seq 0 (chosen twice): −0.001·(0.425557483 + 0.475020813) = −0.000900578296
    #   seq 1 (rejected):     +0.001·0.425557483,   seq 2 (rejected): +0.001·0.475020813
    logp_sum = t([-10.0, -12.0, -11.0], requires_grad=True)
    loss = amir_preference(logp_sum, t([-10.5, -11.0, -11.0]), t([2.0, 0.0, 0.25]), ids([0, 0, 0]))
    assert loss.item() == pytest.approx(0.00599375952271049, rel=1e-12)
    loss.backward()
    assert logp_sum.grad.tolist() == pytest.approx([-0.000900578295709401, 0.000425557483188341, 0.00047502081252106])


def test_amir_ref_free_and_no_pairs():
    # ref-free (ℓ^ref ≡ 0), β = 1, λ = 1: implicit = logp_sum = 0, −1: z = 1 -> ln(1 + e^−1) = 0.313261687518
    logp_sum = t([0.0, -1.0], requires_grad=True)
    loss = amir_preference(logp_sum, None, t([2.0, 0.0]), ids([3, 3]), beta=1.0, lam=1.0)
    assert loss.item() == pytest.approx(0.313261687518223, rel=1e-12)
    # all-equal rewards and a group of one: no pair -> 0, still differentiable (zero gradient)
    empty = amir_preference(logp_sum, None, t([2.0, 2.0]), ids([3, 3]))
    empty.backward()
    assert empty.item() == 0.0 and logp_sum.grad.tolist() == [0.0, 0.0]
    assert amir_preference(t([-1.0]), None, t([2.0]), ids([0])).item() == 0.0


def test_amir_lambda_adapts_within_bounds():
    # ratio = λ·L_pref/L_GRPO; λ0 = 0.01
    state = AMIRLambda()
    assert state.update(grpo_loss=1.0, pref_loss=10.0) == pytest.approx(0.0125)  # ratio 0.1 < 0.3: ×1.25
    assert state.update(grpo_loss=0.1, pref_loss=10.0) == pytest.approx(0.01)  # ratio 1.25 > 0.7: ×0.8
    assert state.update(grpo_loss=0.2, pref_loss=10.0) == pytest.approx(0.01)  # ratio 0.5: unchanged
    assert state.update(grpo_loss=-1.0, pref_loss=1.0) == pytest.approx(0.008)  # L_GRPO < 0 -> ÷1e-9: ×0.8
    for _ in range(30):
        state.update(grpo_loss=1e6, pref_loss=1.0)
    assert state.value == 0.05  # clamped above
    for _ in range(30):
        state.update(grpo_loss=1e-9, pref_loss=1.0)
    assert state.value == 0.005  # clamped below


# ------------------------------------------------------------------------------------------------------ DARO
def test_daro_bin_losses():
    # bins 0, 0, 1, −1 with K = 3: L_0 = (2 + 4)/(2 + 2) = 1.5, L_1 = 3/3 = 1.0, bin 2 empty (absent), −1 dropped
    losses, present = daro_bin_losses(t([2.0, 4.0, 3.0, 9.0]), t([2.0, 2.0, 3.0, 3.0]), ids([0, 0, 1, -1]), 3)
    assert losses.tolist() == [1.5, 1.0, 0.0]
    assert present.tolist() == [True, True, False]


def test_daro_objective_and_gradients():
    # w = softplus(u) = 1 at init (u = ln(e − 1) = 0.541324855); L = 0.5, 2.0
    # value Σ [w·L − ln w] = 0.5 + 2.0 − 0 = 2.5;  ∂/∂w = L − 1/w = −0.5, 1.0;  ∂/∂u = ∂/∂w · σ(u) = · (1 − 1/e)
    daro = DAROWeights(2).double()
    assert daro.u.tolist() == pytest.approx([0.541324854612918] * 2)
    losses = t([0.5, 2.0], requires_grad=True)
    value = daro(losses)
    value.backward()
    assert value.item() == pytest.approx(2.5)
    assert daro.u.grad.tolist() == pytest.approx([-0.5 * 0.6321205588285577, 1.0 * 0.6321205588285577])
    assert losses.grad.tolist() == pytest.approx([1.0, 1.0])  # policy gradient w·∂L


def test_daro_non_positive_loss_uses_the_magnitude_proxy():
    # L = −0.5: value w·L − ln w = −0.5 (unchanged); the w-gradient uses |L|: 0.5 − 1/w = −0.5 (plain: −1.5),
    # so w* = 1/|L| = 2 is finite; the policy gradient is still w = 1. An absent bin adds nothing.
    daro = DAROWeights(2).double()
    losses = t([-0.5, 7.0], requires_grad=True)
    value = daro(losses, present=torch.tensor([True, False]))
    value.backward()
    assert value.item() == pytest.approx(-0.5)
    assert daro.u.grad.tolist() == pytest.approx([-0.5 * 0.6321205588285577, 0.0])
    assert losses.grad.tolist() == pytest.approx([1.0, 0.0])


def test_daro_gradcheck():
    daro = DAROWeights(3, init=0.7).double()
    u = (daro.u.detach() + t([0.3, -0.2, 0.1])).requires_grad_()
    losses = t([0.4, 1.3, 2.2], requires_grad=True)  # positive, where the proxy equals L

    def objective(u, losses):
        return functional_call(daro, {"u": u}, (losses, torch.tensor([True, True, False])))

    assert torch.autograd.gradcheck(objective, (u, losses))


# ------------------------------------------------------------------------------------------------- Info-GRPO
def test_info_grpo_worked_example():
    # per-sequence token means: seq 0 (ori) (1 + 2)/2 = 1.5, seq 1 (ori) 9/3 = 3.0, seq 2 (aug) (0.5 + 0.5)/2 = 0.5
    # H_ori = (1.5 + 3.0)/2 = 2.25, H_aug = 0.5 -> loss = −λ(α·H_ori − H_aug) = −0.1·(2.25 − 0.5) = −0.175
    # d/dentropy: seq 0 −λα/(2·2) = −0.025 per kept token, seq 1 −0.1/(2·3) = −0.0166667, seq 2 +0.1/2 = +0.05
    entropy = t([[1.0, 2.0, 0.0], [3.0, 3.0, 3.0], [0.5, 0.5, 9.0]], requires_grad=True)
    mask = t([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    loss = info_grpo(entropy, mask, torch.tensor([False, False, True]))
    assert loss.item() == pytest.approx(-0.175)
    loss.backward()
    third = 0.1 / 6
    assert entropy.grad.flatten().tolist() == pytest.approx(
        [-0.025, -0.025, 0.0, -third, -third, -third, 0.05, 0.05, 0.0]
    )
    with pytest.raises(ValueError, match="augmented must mark at least one original and one augmented sequence"):
        info_grpo(entropy, mask, torch.tensor([True, True, True]))


def test_info_grpo_docstring_says_unverified():
    assert "unverified" in REGULARIZERS.component("info_grpo").summary
    assert "unverified" in REGULARIZERS.component("info_grpo").paper
    assert "**unverified**" in DAROWeights.__doc__


# --------------------------------------------------------------------------------------------------- TR-GRPO
def test_tr_grpo_weights_rise_with_probability():
    # w = clip(2·(σ(9p) − 0.25), 1, 1.4):
    #   p = 0.05: 2·(σ(0.45) − 0.25) = 0.721278 -> 1.0      p = 0.2: 2·(σ(1.8) − 0.25) = 1.216297870
    #   p = 0.5:  2·(σ(4.5) − 0.25) = 1.478026 -> 1.4      p = 1:   2·(σ(9) − 0.25) = 1.499753 -> 1.4
    logp = t([[math.log(0.05), math.log(0.2)], [math.log(0.5), 0.0]], requires_grad=True)
    w = tr_grpo_weights(logp)
    assert w.flatten().tolist() == pytest.approx([1.0, 1.2162978701990246, 1.4, 1.4])
    assert not w.requires_grad  # sg(·): a weight, not a path for gradients


def test_tr_grpo_is_not_the_composers_no_op():
    # spec §26 item 5: the composer's σ(p/τ) with τ = 9 lies in [σ(0), σ(1/9)] = [0.5, 0.527749], so
    # 2·(σ − 0.25) ∈ [0.5, 0.555498] and every weight clamps to L = 1: a no-op. Its doc claims high-probability
    # tokens are down-weighted. The paper's weight increases with p, so ours must vary and be non-decreasing.
    p = torch.linspace(0.0, 1.0, 101, dtype=F64)
    composer = (2.0 * (torch.sigmoid(p / 9.0) - 0.25)).clamp(1.0, 1.4)
    assert composer.eq(1.0).all()
    w = tr_grpo_weights(p.log().unsqueeze(0)).squeeze(0)
    assert (w[1:] >= w[:-1]).all()
    assert w[0].item() == 1.0 and w[-1].item() == pytest.approx(1.4)
    assert w.max() > w.min()


# ---------------------------------------------------------------------------------------------------- λ-GRPO
def test_lambda_grpo_worked_example():
    # group 0 lengths 1, 2, 3: mean 2, unbiased std 1 -> z = −1, 0, 1 (ε = 1e-12); r = 0.5: h = 0.5, 1, 1.5
    # λ = 2: g = h² = 0.25, 1, 2.25; e^g = 1.284025417, 2.718281828, 9.487735836 (Σ 13.490043082)
    # f = 3·e^g/Σ = 0.285549588, 0.604508483, 2.109941928
    # group 9: a group of one -> z = 0 -> f = 1·softmax([1]) = 1
    weights = LambdaGRPOWeights(lam=2.0, r=0.5, eps=1e-12).double()
    f = weights(t([1.0, 2.0, 7.0, 3.0]), ids([0, 0, 9, 0]))
    assert f.tolist() == pytest.approx([0.28554958844752504, 0.6045084834871529, 1.0, 2.1099419280653224])


def test_lambda_grpo_zero_is_uniform_and_sign_sets_the_preference():
    lengths, groups = t([10.0, 40.0, 20.0, 30.0, 5.0, 5.0]), ids([1, 1, 1, 1, 2, 2])
    assert LambdaGRPOWeights()(lengths, groups).tolist() == pytest.approx([1.0] * 6)  # λ = 0: DAPO
    short = LambdaGRPOWeights(lam=-1.0)(lengths, groups).detach()
    long = LambdaGRPOWeights(lam=1.0)(lengths, groups).detach()
    assert short[0] > short[2] > short[3] > short[1]  # λ < 0 favours short outputs
    assert long[1] > long[3] > long[2] > long[0]  # λ > 0 favours long ones
    assert short[4:].tolist() == pytest.approx([1.0, 1.0])  # equal lengths: z = 0
    assert short[:4].sum().item() == pytest.approx(4.0)  # f sums to G in each group


def test_lambda_grpo_gradcheck_unequal_groups():
    weights = LambdaGRPOWeights(r=0.1111).double()
    lengths, groups = t([12.0, 30.0, 7.0, 19.0, 50.0, 3.0]), ids([0, 0, 0, 1, 1, 2])
    lam = t(-0.7, requires_grad=True)
    assert torch.autograd.gradcheck(lambda lam: functional_call(weights, {"lam": lam}, (lengths, groups)), (lam,))


# ------------------------------------------------------------------------------------------------ input checks
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_inputs_are_rejected(bad):
    with pytest.raises(ValueError, match=rf"rewards must be finite, got {bad} at index 1"):
        amir_preference(t([0.0, 0.0]), None, t([1.0, bad]), ids([0, 0]))
    with pytest.raises(ValueError, match=rf"lengths must be finite, got {bad} at index 1"):
        LambdaGRPOWeights()(t([3.0, bad]), ids([0, 0]))


def test_shape_mismatches_are_rejected():
    with pytest.raises(ValueError, match=r"rewards must be \[B\] = \[2\], got \[3\]"):
        amir_preference(t([0.0, 0.0]), None, t([1.0, 0.0, 1.0]), ids([0, 0, 0]))
    with pytest.raises(ValueError, match=r"ref_logp_sum must be \[B\] = \[2\], got \[1\]"):
        amir_preference(t([0.0, 0.0]), t([0.0]), t([1.0, 0.0]), ids([0, 0]))
    with pytest.raises(ValueError, match=r"group_ids must be \[B\] = \[2\]"):
        LambdaGRPOWeights()(t([3.0, 4.0]), ids([0, 0, 1]))
    with pytest.raises(ValueError, match=r"bin_losses must be \[K\] = \[2\], got \[3\]"):
        DAROWeights(2)(torch.zeros(3))
    with pytest.raises(ValueError, match=r"logp must be a non-empty \[B, T\] tensor, got \[3\]"):
        tr_grpo_weights(t([0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] = \[1, 2\]"):
        info_grpo(t([[0.0, 0.0]]), t([[1.0]]), torch.tensor([True]))
    with pytest.raises(ValueError, match="pair_mining must be 'all' or 'topk', got 'best'"):
        amir_pairs(t([1.0, 0.0]), ids([0, 0]), pair_mining="best")


# ------------------------------------------------------------------------------------------------------ registry
def test_registry_lists_every_regularizer_with_its_paper():
    assert REGULARIZERS.names() == ["amir", "daro", "info_grpo", "lambda_grpo", "tr_grpo"]
    assert {c.name: c.obj for c in REGULARIZERS} == {
        "amir": amir_preference,
        "daro": DAROWeights,
        "info_grpo": info_grpo,
        "lambda_grpo": LambdaGRPOWeights,
        "tr_grpo": tr_grpo_weights,
    }
    papers = {c.name: c.paper for c in REGULARIZERS}
    for name, arxiv in [("amir", "2601.03661"), ("daro", "2510.09001"), ("lambda_grpo", "2510.06870")]:
        assert f"arXiv:{arxiv}" in papers[name]
    assert "arXiv:2511.00066" in papers["tr_grpo"]
    assert all(c.summary for c in REGULARIZERS)


def test_unknown_regularizer_lists_valid_choices():
    valid = r"\['amir', 'daro', 'info_grpo', 'lambda_grpo', 'tr_grpo'\]"
    with pytest.raises(ValueError, match=rf"unknown regularizer 'kl'; valid choices: {valid}"):
        REGULARIZERS.get("kl")

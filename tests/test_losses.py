"""The loss algebra: a hand-worked example per registered loss type, float64 gradchecks, and registry facts.

Worked examples drive `build_terms` + `compute_loss` on explicit per-token log-probs. The expected numbers come
from TRL's `GRPOTrainer._compute_loss` formulas (one process, no gradient accumulation), derived by hand in the
comments; the tests hold literals, never a second implementation of the formula.

Shared example (B = 2, T = 3, the last token of sequence 1 is padding; default ε_low = ε_high = 0.2, so the
clip range is [0.8, 1.2]):

    logp   = [[-1.0, -2.0, -0.5], [-1.5, -0.7, (-3.0)]]
    ρ      = [[ 1.5,  0.5,  1.1], [ 0.7,  1.3, ( 2.0)]]      old_logp = logp − ln ρ
    A      = [+1, −2]                                        (per sequence)

Clipped surrogate −min(ρA, clip(ρ, 0.8, 1.2)A) per kept token:
    (0,0) A>0, ρ=1.5 > 1.2  clipped high: −min(1.5, 1.2)   = −1.2   dL/dlogp = 0
    (0,1) A>0, ρ=0.5        unclipped:    −min(0.5, 0.8)   = −0.5   dL/dlogp = −w·A·ρ = −0.5w
    (0,2) A>0, ρ=1.1        unclipped:    −min(1.1, 1.1)   = −1.1   dL/dlogp = −1.1w
    (1,0) A<0, ρ=0.7 < 0.8  clipped low:  −min(−1.4, −1.6) = +1.6   dL/dlogp = 0
    (1,1) A<0, ρ=1.3        unclipped:    −min(−2.6, −2.4) = +2.6   dL/dlogp = −w·(−2)·1.3 = +2.6w
Row sums: −2.8 (3 tokens) and +4.2 (2 tokens); 5 kept tokens in all. w is each token's normaliser weight.
"""

from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.losses.aggregate import NORMALISERS
from grpo_kernels.losses.loss import compute_loss
from grpo_kernels.losses.terms import build_terms
from grpo_kernels.options import TOKEN_LEVEL_ONLY_TYPES, LossOptions

F64 = torch.float64
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
RATIO = [[1.5, 0.5, 1.1], [0.7, 1.3, 2.0]]
ADV = [1.0, -2.0]
LN2 = math.log(2.0)
# ref_logp − logp for the KL examples: k3 D = e^x − x − 1 gives
#   x = +ln 2: D = 2 − ln 2 − 1 = 0.30685281944,  dD/dlogp = 1 − e^x = −1
#   x = −ln 2: D = 0.5 + ln 2 − 1 = 0.19314718056, dD/dlogp = 1 − e^x = +0.5
#   x = 0:     D = 0,                               dD/dlogp = 0
REF_MINUS_LOGP = [[LN2, -LN2, 0.0], [LN2, 0.0, 5.0]]


def run(
    options: LossOptions,
    ratio=RATIO,
    *,
    log_ratio=None,
    advantages=ADV,
    ref_minus_logp=None,
    entropy=None,
    is_ratio=None,
):
    """compute_loss on the shared example (old_logp = logp − ln ρ); returns (loss, metrics, dL/dlogp) as floats."""
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    log_ratio = torch.tensor(ratio, dtype=F64).log() if log_ratio is None else torch.tensor(log_ratio, dtype=F64)
    ref = None if ref_minus_logp is None else logp.detach() + torch.tensor(ref_minus_logp, dtype=F64)
    tensor = lambda x: None if x is None else torch.tensor(x, dtype=F64)
    terms = build_terms(
        logp,
        old_logp=logp.detach() - log_ratio,
        ref_logp=ref,
        advantages=tensor(advantages),
        mask=tensor(MASK),
        entropy=tensor(entropy),
        is_ratio=tensor(is_ratio),
        options=options,
    )
    out, _ = compute_loss(terms, options)
    out.loss.backward()
    return out.loss.item(), {k: v.item() for k, v in out.metrics.items()}, logp.grad.flatten().tolist()


def approx(expected):
    """Relative 1e-6 on the hand-derived numbers; exact zeros (clipped or padded tokens) stay within 1e-12."""
    if isinstance(expected, list) and isinstance(expected[0], list):
        expected = [x for row in expected for x in row]
    return pytest.approx(expected, rel=1e-6, abs=1e-12)


# ----------------------------------------------------------------------------------------------- clip family


def test_grpo():
    """DeepSeekMath / TRL "grpo": each sequence's token mean of the clipped surrogate, then the mean over B."""
    loss, metrics, grad = run(LossOptions(loss_type="grpo"))
    # L = (−2.8/3 + 4.2/2) / 2 = (−0.93333333 + 2.1) / 2 = 0.58333333;  w = 1/(B·|o_i|) = 1/6 (row 0), 1/4 (row 1)
    assert loss == approx(0.5833333333333333)
    # grads: (0,1) −0.5/6, (0,2) −1.1/6, (1,1) +2.6/4; clipped (0,0), (1,0) and padded (1,2) are 0
    assert grad == approx([[0.0, -0.5 / 6, -1.1 / 6], [0.0, 0.65, 0.0]])
    # flags over the 5 kept tokens: low = {(1,0)}, high = {(0,0)}; ratio/mean = (1.5+0.5+1.1+0.7+1.3)/5 = 1.02
    assert metrics["clip_ratio/low_mean"] == approx(0.2)
    assert metrics["clip_ratio/high_mean"] == approx(0.2)
    assert metrics["clip_ratio/region_mean"] == approx(0.4)
    assert metrics["ratio/mean"] == approx(1.02)
    assert "kl" not in metrics


def test_grpo_sequence_level_gspo():
    """GSPO (importance_sampling_level="sequence"): one ratio per sequence, exp of the masked mean log-ratio."""
    # token log-ratios [0.3, −0.1, 0.1] → mean 0.1 → s0 = e^0.1 = 1.10517092 (in [0.8, 1.2], A>0: unclipped);
    # [−0.5, −0.1, (5.0 padded)] → mean −0.3 → s1 = e^−0.3 = 0.74081822 < 0.8 with A<0: clipped low to 0.8.
    # Per-token [B, 1] losses: −s0·1 = −1.10517092 and −(0.8·−2) = +1.6; the token mean of a constant is itself:
    # L = (−1.10517092 + 1.6) / 2 = 0.24741454.
    # dL/dlogp_{0,t} = −(1/B)·A·ds0/dlogp_t = −(1/2)·s0/3 = −s0/6 = −0.18419515 for all 3 tokens; row 1 clipped: 0.
    options = LossOptions(loss_type="grpo", importance_sampling_level="sequence")
    loss, metrics, grad = run(options, log_ratio=[[0.3, -0.1, 0.1], [-0.5, -0.1, 5.0]])
    assert loss == approx(0.2474145409621762)
    assert grad == approx([[-0.18419515301260794] * 3, [0.0, 0.0, 0.0]])
    # sequence-level flags are per sequence: low = {row 1} → 1/2; ratio/mean = (s0 + s1)/2 = 0.92299457
    assert metrics["clip_ratio/low_mean"] == approx(0.5)
    assert metrics["clip_ratio/high_mean"] == approx(0.0)
    assert metrics["clip_ratio/region_mean"] == approx(0.5)
    assert metrics["ratio/mean"] == approx(0.9229945693786827)


def test_bnpo():
    """TRL "bnpo": masked token mean over the local batch."""
    loss, metrics, grad = run(LossOptions(loss_type="bnpo"))
    # L = (−2.8 + 4.2) / 5 = 0.28;  w = 1/5
    assert loss == approx(0.28)
    # (0,1) −0.5/5 = −0.1, (0,2) −1.1/5 = −0.22, (1,1) +2.6/5 = 0.52
    assert grad == approx([[0.0, -0.1, -0.22], [0.0, 0.52, 0.0]])
    assert metrics["clip_ratio/region_mean"] == approx(0.4)


def test_dr_grpo():
    """Dr. GRPO (arXiv:2503.20783): masked token sum over the constant B · max_completion_length."""
    loss, _, grad = run(LossOptions(loss_type="dr_grpo", max_completion_length=4))
    # L = 1.4 / (2·4) = 0.175;  w = 1/8
    assert loss == approx(0.175)
    # (0,1) −0.5/8 = −0.0625, (0,2) −1.1/8 = −0.1375, (1,1) +2.6/8 = 0.325
    assert grad == approx([[0.0, -0.0625, -0.1375], [0.0, 0.325, 0.0]])


@pytest.mark.parametrize("items", [10.0, torch.tensor(10.0)], ids=["float", "tensor"])
def test_dapo(items):
    """DAPO (arXiv:2503.14476): clip-higher ε_high = 0.28, masked token sum over num_items_in_batch."""
    # ρ = [[1.25, 0.5, 1.5], [0.7, 1.3, (2.0)]], range [0.8, 1.28]:
    #   (0,0) A>0, 1.25 ≤ 1.28: unclipped −1.25 (GRPO's ε = 0.2 would clip it)    dL/dlogp = −1.25/10
    #   (0,1) unclipped −0.5;  (0,2) 1.5 > 1.28 clipped high −1.28, grad 0
    #   (1,0) clipped low +1.6, grad 0;  (1,1) A<0, 1.3: unclipped +2.6              dL/dlogp = +2.6/10
    # sum = −1.25 − 0.5 − 1.28 + 1.6 + 2.6 = 1.17;  L = 1.17 / 10 = 0.117 (global count 10, local only 5)
    ratio = [[1.25, 0.5, 1.5], [0.7, 1.3, 2.0]]
    loss, metrics, grad = run(LossOptions(loss_type="dapo", epsilon_high=0.28, num_items_in_batch=items), ratio)
    assert loss == approx(0.117)
    assert grad == approx([[-0.125, -0.05, 0.0], [0.0, 0.26, 0.0]])
    assert metrics["clip_ratio/high_mean"] == approx(0.2)
    assert metrics["clip_ratio/low_mean"] == approx(0.2)
    # without num_items_in_batch the count is this batch's 5 kept tokens: 1.17 / 5 = 0.234
    assert run(LossOptions(loss_type="dapo", epsilon_high=0.28), ratio)[0] == approx(0.234)


def test_luspo_sequence_level():
    """LUSPO: GSPO's sequence ratio, each sequence's token *sum*, then the mean over B (scales with length)."""
    # log-ratios [0.5, 0.0, 0.25] → mean 0.25 → s0 = e^0.25 = 1.28402542 > 1.2, A>0: clipped high → −1.2 per token;
    # [−0.3, 0.1, (5.0)] → mean −0.1 → s1 = e^−0.1 = 0.90483742, A<0: unclipped → −(s1·−2) = 1.80967484 per token.
    # L = (3·(−1.2) + 2·1.80967484) / 2 = (−3.6 + 3.61934967) / 2 = 0.00967484
    # dL/dlogp_{1,t} = (1/B)·Σ_t' −A·ds1/dlogp_t = (1/2)·2·(2·s1/2) = s1 = 0.90483742; row 0 clipped: 0.
    options = LossOptions(loss_type="luspo", importance_sampling_level="sequence")
    loss, metrics, grad = run(options, log_ratio=[[0.5, 0.0, 0.25], [-0.3, 0.1, 5.0]])
    assert loss == approx(0.009674836071919213)
    assert grad == approx([[0.0, 0.0, 0.0], [0.9048374180359595, 0.9048374180359595, 0.0]])
    assert metrics["clip_ratio/high_mean"] == approx(0.5)
    assert metrics["clip_ratio/low_mean"] == approx(0.0)


def test_delta_two_sided_clipping():
    """delta (INTELLECT-2): the unclipped branch's ratio is capped at δ, bounding A<0 tokens with a large ratio."""
    # δ = 1.25 on the shared example: (1,1) A<0, ρ = 1.3 → capped 1.25: −min(1.25·−2, 1.2·−2) = +2.5, and the
    # cap (clamp) zeroes its gradient. (0,0): −min(min(1.5, 1.25)·1, 1.2) = −1.2, still clipped high.
    # L = (−2.8/3 + (1.6 + 2.5)/2) / 2 = (−0.93333333 + 2.05) / 2 = 0.55833333
    loss, metrics, grad = run(LossOptions(loss_type="grpo", delta=1.25))
    assert loss == approx(0.5583333333333333)
    assert grad == approx([[0.0, -0.5 / 6, -1.1 / 6], [0.0, 0.0, 0.0]])
    assert metrics["clip_ratio/high_mean"] == approx(0.2)  # flags use the capped ratio: 1.25 > 1.2 still high


# ---------------------------------------------------------------------------------- KL, IS ratio, entropy


def test_kl_k3():
    """beta != 0 adds β·k3 per token before the normaliser; d(β·D)/dlogp = β·(1 − e^{ref−logp})."""
    options = LossOptions(loss_type="grpo", beta=0.1, use_bias_correction_kl=False)
    loss, metrics, grad = run(options, ref_minus_logp=REF_MINUS_LOGP)
    # D = [[0.30685282, 0.19314718, 0], [0.30685282, 0, (pad)]]; row means: (0.30685282 + 0.19314718)/3 = 0.5/3 and
    # 0.30685282/2 = 0.15342641 → Agg D = (0.16666667 + 0.15342641)/2 = 0.16004654.
    # L = 0.58333333 (test_grpo) + 0.1·0.16004654 = 0.59933799
    assert loss == approx(0.5993379871526681)
    # grads = policy + β·w·(1 − e^x):  (0,0) 0 + 0.1/6·(−1) = −1/60;  (0,1) −0.5/6 + 0.1/6·0.5 = −0.075;
    # (0,2) −1.1/6 + 0;  (1,0) 0 + 0.1/4·(−1) = −0.025;  (1,1) 2.6/4 + 0 = 0.65
    assert grad == approx([[-1 / 60, -0.075, -1.1 / 6], [-0.025, 0.65, 0.0]])
    # kl metric: masked token mean of D = (0.5 + 0.30685282)/5 = 0.16137056
    assert metrics["kl"] == approx(0.16137056388801094)


def test_kl_bias_correction():
    """use_bias_correction_kl (DeepSeek-V3.2): the k3 term times the unclipped, differentiable ratio ρ."""
    options = LossOptions(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True)
    loss, metrics, grad = run(options, ref_minus_logp=REF_MINUS_LOGP)
    # ρ·D = [1.5·0.30685282, 0.5·0.19314718, 1.1·0, 0.7·0.30685282, 1.3·0] → sum 2.2·0.30685282 + 0.09657359
    #     = 0.77164979.  bnpo: L = (1.4 + 0.1·0.77164979) / 5 = 0.29543300;  kl metric = 0.77164979/5 = 0.15432996
    assert loss == approx(0.29543299586096183)
    assert metrics["kl"] == approx(0.1543299586096186)
    # d(ρD)/dlogp = ρ·(1 − e^x + D), w = 1/5:
    #   (0,0) 0 + 0.1·0.2·1.5·(−1 + 0.30685282) = −0.02079442
    #   (0,1) −0.1 + 0.1·0.2·0.5·(0.5 + 0.19314718) = −0.1 + 0.00693147 = −0.09306853
    #   (0,2) −0.22 + 0;  (1,0) 0 + 0.1·0.2·0.7·(−0.69314718) = −0.00970406;  (1,1) 0.52 + 0
    assert grad == approx([[-0.020794415416798356, -0.09306852819440055, -0.22], [-0.009704060527839, 0.52, 0.0]])


def test_is_ratio_multiplies_policy_term_only():
    """is_ratio (rollout IS weight) multiplies the policy term, not the KL term."""
    options = LossOptions(loss_type="grpo", beta=0.1, use_bias_correction_kl=False)
    loss, _, grad = run(options, ref_minus_logp=REF_MINUS_LOGP, is_ratio=[0.5, 2.0])
    # L = (0.5·(−2.8/3) + 2·(4.2/2)) / 2 + 0.1·0.16004654 (KL as in test_kl_k3, unweighted)
    #   = (−0.46666667 + 4.2)/2 + 0.01600465 = 1.86666667 + 0.01600465 = 1.88267132
    assert loss == approx(1.8826713204860015)
    # (0,1) 0.5·(−0.5/6) + 0.1/6·0.5 = −0.03333333;  (1,1) 2·2.6/4 = 1.3;  (0,0) KL only −1/60
    assert grad[1] == approx(-1 / 30)
    assert grad[4] == approx(1.3)
    assert grad[0] == approx(-1 / 60)


def test_top_entropy_quantile():
    """top_entropy_quantile (arXiv:2506.01939): only tokens at or above the (1 − q) entropy quantile keep a loss."""
    # kept entropies [0.1, 0.9, 0.5, 0.7, 0.3] (the padded 9.9 is ignored); q = 0.6 → quantile 0.4 of the sorted
    # [0.1, 0.3, 0.5, 0.7, 0.9]: position 0.4·4 = 1.6 → 0.3 + 0.6·0.2 = 0.42 → keep (0,1), (0,2), (1,0).
    # Surrogate [[−1.2, −0.5, −1.1], [1.6, 2.6]] → [[0, −0.5, −1.1], [1.6, 0]]; denominators stay |o_i| (3, 2):
    # L = (−1.6/3 + 1.6/2) / 2 = (−0.53333333 + 0.8) / 2 = 0.13333333
    entropy = [[0.1, 0.9, 0.5], [0.7, 0.3, 9.9]]
    loss, metrics, grad = run(LossOptions(loss_type="grpo", top_entropy_quantile=0.6), entropy=entropy)
    assert loss == approx(0.13333333333333333)
    assert grad == approx([[0.0, -0.5 / 6, -1.1 / 6], [0.0, 0.0, 0.0]])  # (1,1) dropped, (1,0) clipped
    assert metrics["entropy"] == approx(0.5)  # (0.1 + 0.9 + 0.5 + 0.7 + 0.3) / 5


# ------------------------------------------------------------------------------------ REINFORCE-style types


def test_cispo():
    """CISPO (MiniMax-M1; TRL's form): −sg(min(ρ, ε_high))·A·logp, ε_high an absolute cap; token sum / count."""
    # ε_high = 1.25 caps ρ: c = [[1.25, 0.5, 1.1], [0.7, 1.25]]; per token −c·A·logp:
    #   row 0 (A = 1):  −1.25·(−1.0) = 1.25,  −0.5·(−2.0) = 1.0,  −1.1·(−0.5) = 0.55   → 2.8
    #   row 1 (A = −2): −0.7·(−2)·(−1.5) = −2.1,  −1.25·(−2)·(−0.7) = −1.75           → −3.85
    # L = (2.8 − 3.85) / 5 = −0.21.  dL/dlogp = −c·A/5 (the weight is detached, so no ρ' term), even where capped:
    #   [−0.25, −0.1, −0.22], [0.28, 0.5]
    loss, metrics, grad = run(LossOptions(loss_type="cispo", epsilon_high=1.25))
    assert loss == approx(-0.21)
    assert grad == approx([[-0.25, -0.1, -0.22], [0.28, 0.5, 0.0]])
    # cispo_clip_ratio: ρ > ε_high with A > 0 → only (0,0) ((1,1) has A < 0) → 1/5
    assert metrics["cispo_clip_ratio"] == approx(0.2)
    assert metrics["clip_ratio/high_mean"] == approx(0.2)
    assert metrics["clip_ratio/low_mean"] == approx(0.0)


def test_sapo():
    """SAPO (arXiv:2511.20347): soft gate −σ(τ(ρ − 1))·4/τ·A, τ = 1.0 (A > 0) or 1.05; sequence mean."""
    # ρ = [[1.5, 0.5, 1.0], [0.7, 1.3]]
    # row 0, τ = 1: σ(0.5) = 0.62245933, σ(−0.5) = 0.37754067, σ(0) = 0.5 → losses −4σ: sum −4·(σ(.5)+σ(−.5)) − 2
    #   = −6 → row mean −2.
    # row 1, τ = 1.05: σ(−0.315) = 0.42189477, σ(0.315) = 0.57810523 (sum 1) → losses −σ·4/1.05·(−2): sum 8/1.05
    #   = 7.61904762 → row mean 3.80952381.   L = (−2 + 3.80952381)/2 = 19/21 = 0.90476190
    # dL/dlogp = −w·A·4σ(1−σ)·ρ:
    #   (0,0) −(1/6)·4·0.23500371·1.5 = −0.23500371   (0,1) −(1/6)·4·0.23500371·0.5 = −0.07833457
    #   (0,2) −(1/6)·4·0.25·1 = −1/6                   (1,0) −(1/4)·(−2)·4·0.24389957·0.7 = 0.34145940
    #   (1,1) −(1/4)·(−2)·4·0.24389957·1.3 = 0.63413889
    loss, _, grad = run(LossOptions(loss_type="sapo"), [[1.5, 0.5, 1.0], [0.7, 1.3, 2.0]])
    assert loss == approx(19 / 21)
    assert grad == approx(
        [[-0.23500371220159447, -0.07833457073386482, -1 / 6], [0.341459401634523, 0.6341388887498284, 0.0]]
    )


def test_vespo():
    """VESPO (arXiv:2602.10693): −sg(φ(w))·A·logp, φ(w) = e^λ·w^k·e^(−λw), w = Π_t ρ_t; token sum / count."""
    # row 0, A > 0 (k, λ) = (2, 3): log w = 0.2 + (−0.1) + 0.1 = 0.2, w = 1.22140276
    #   φ0 = exp(3 + 2·0.2 − 3·1.22140276) = exp(−0.26420827) = 0.76781361
    # row 1, A < 0 (k, λ) = (3, 2): log w = −0.3 + 0.1 = −0.2 (padded 5.0 ignored), w = 0.81873075
    #   φ1 = exp(2 + 3·(−0.2) − 2·0.81873075) = exp(−0.23746151) = 0.78862725
    # Σ logp: row 0 −3.5, row 1 −2.2.  L = (−φ0·1·(−3.5) − φ1·(−2)·(−2.2)) / 5 = (3.5φ0 − 4.4φ1)/5 = −0.15652245
    # dL/dlogp = −φ·A/5: row 0 −0.15356272, row 1 +0.31545090
    loss, metrics, grad = run(LossOptions(loss_type="vespo"), log_ratio=[[0.2, -0.1, 0.1], [-0.3, 0.1, 5.0]])
    assert loss == approx(-0.1565224530525991)
    assert grad == approx([[-0.15356272140444202] * 3, [0.31545089907643004] * 2 + [0.0]])
    assert metrics["vespo/phi_seq_mean"] == approx(0.7782204273566427)  # (φ0 + φ1)/2


def test_vespo_is_ratio_enters_phi():
    """For vespo, is_ratio joins the sequence weight w (log-space sum) instead of multiplying the loss."""
    # is_ratio = [e^−0.2, e^0.2] cancels both rows' log w (0.2 and −0.2): w = 1, φ(1) = e^λ·1·e^−λ = 1.
    # L = (3.5 − 4.4)/5 = −0.18;  dL/dlogp = −A/5: row 0 −0.2, row 1 +0.4
    loss, metrics, grad = run(
        LossOptions(loss_type="vespo"),
        log_ratio=[[0.2, -0.1, 0.1], [-0.3, 0.1, 5.0]],
        is_ratio=[math.exp(-0.2), math.exp(0.2)],
    )
    assert loss == approx(-0.18)
    assert grad == approx([[-0.2] * 3, [0.4, 0.4, 0.0]])
    assert metrics["vespo/phi_seq_mean"] == approx(1.0)


# --------------------------------------------------------------------------------- divergence trust regions
# p = e^logp and p_old = p/ρ of the shared example's kept tokens, and the binary KL
# d = p_old·ln(p_old/p) + (1 − p_old)·ln((1 − p_old)/(1 − p)):
#   (0,0) p 0.36788 p_old 0.24525  p − p_old +0.12263  d 0.03438
#   (0,1) p 0.13534 p_old 0.27067  p − p_old −0.13534  d 0.06347
#   (0,2) p 0.60653 p_old 0.55139  p − p_old +0.05514  d 0.00628
#   (1,0) p 0.22313 p_old 0.31876  p − p_old −0.09563  d 0.02421
#   (1,1) p 0.49659 p_old 0.38199  p − p_old +0.11460  d 0.02653
# clip_ratio_c = 1.2 truncates the detached weight: w = min(ρ, 1.2) = [[1.2, 0.5, 1.1], [0.7, 1.2]].


def test_dppo_tv():
    """DPPO-Binary-TV (arXiv:2602.04879, verl dppo_tv): −sg(min(ρ, c))·A·logp where p − p_old ≤ ε_high (A > 0)
    or ≥ −ε_low (A ≤ 0), else 0; token sum / count."""
    # ε = 0.1: (0,0) rose by 0.123 > 0.1 with A > 0 → masked; every other token is inside.
    # losses −A·w·logp: (0,1) 0.5·2 = 1.0, (0,2) 1.1·0.5 = 0.55, (1,0) −2·0.7·1.5 = −2.1, (1,1) −2·1.2·0.7 = −1.68
    # L = (1.0 + 0.55 − 2.1 − 1.68)/5 = −0.446;  dL/dlogp = −A·w·inside/5 = [0, −0.1, −0.22], [0.28, 0.48]
    loss, metrics, grad = run(LossOptions(loss_type="dppo_tv", epsilon=0.1, clip_ratio_c=1.2))
    assert loss == approx(-0.446)
    assert grad == approx([[0.0, -0.1, -0.22], [0.28, 0.48, 0.0]])
    assert metrics["clip_ratio/high_mean"] == approx(0.2)  # (0,0)
    assert metrics["clip_ratio/low_mean"] == approx(0.0)
    assert metrics["clip_ratio/truncated_mean"] == approx(0.2)  # (1,1): ρ = 1.3 > 1.2 inside; (0,0) is masked


def test_dppo_kl():
    """DPPO-Binary-KL (verl dppo_kl): masked where the binary KL passes ε on the side A pushes p."""
    # ε = 0.02: (0,0) d 0.034 > ε and p rose with A > 0 → masked; (1,0) d 0.024 > ε and p fell with A < 0 → masked;
    # (0,1) fell with A > 0, (1,1) rose with A < 0: inside whatever d; (0,2) d 0.006 ≤ ε.
    # L = (1.0 + 0.55 − 1.68)/5 = −0.026;  dL/dlogp = [0, −0.1, −0.22], [0, 0.48]
    loss, metrics, grad = run(LossOptions(loss_type="dppo_kl", epsilon=0.02, clip_ratio_c=1.2))
    assert loss == approx(-0.026)
    assert grad == approx([[0.0, -0.1, -0.22], [0.0, 0.48, 0.0]])
    assert (metrics["clip_ratio/low_mean"], metrics["clip_ratio/high_mean"]) == approx([0.2, 0.2])
    assert metrics["clip_ratio/region_mean"] == approx(0.4)


def test_dppo_without_cap_is_untruncated():
    """clip_ratio_c = None: the weight is sg(ρ) itself (TV ε = 0.2 masks nothing here)."""
    # per token −A·ρ·logp: 1.5, 1.0, 0.55, −2.1, −1.82 → sum −0.87, L = −0.174;  dL/dlogp = −A·ρ/5
    loss, metrics, grad = run(LossOptions(loss_type="dppo_tv"))
    assert loss == approx(-0.174)
    assert grad == approx([[-0.3, -0.1, -0.22], [0.28, 0.52, 0.0]])
    assert "clip_ratio/truncated_mean" not in metrics


def test_dro():
    """DRO (arXiv:2405.19107, verl dro): −(A·logp − ½β(logp − old_logp)²); token sum / count."""
    # β = 0.5, ln ρ = [[0.40547, −0.69315, 0.09531], [−0.35667, 0.26236]], Σ (ln ρ)² = 0.84999102
    # Σ −A·logp = 3.5 − 4.4 = −0.9;  L = (−0.9 + 0.25·0.84999102)/5 = −0.13750045
    # dL/dlogp = (−A + β·ln ρ)/5
    loss, metrics, grad = run(LossOptions(loss_type="dro", dro_beta=0.5))
    assert loss == approx(-0.13750044894555183)
    row_0 = [-0.15945348918918356, -0.26931471805599455, -0.1904689820195675]
    assert grad == approx([row_0, [0.36433250560612673, 0.42623642644674914, 0.0]])
    assert metrics["clip_ratio/region_mean"] == 0.0


def test_dro_and_dppo_options_are_checked():
    with pytest.raises(ValueError, match="dro_beta > 0"):
        LossOptions(loss_type="dro")
    with pytest.raises(ValueError, match="dro_beta applies to loss_type='dro'"):
        LossOptions(loss_type="grpo", dro_beta=0.1)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 0"):
        LossOptions(loss_type="dppo_kl", clip_ratio_c=0.0)
    assert LossOptions(loss_type="dppo_tv", clip_ratio_c=0.9).clip_ratio_c == 0.9  # a cap, not a dual clip


# ------------------------------------------------------------------------------------------- gradcheck

GRADCHECK_OPTIONS = {
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {"max_completion_length": 4},
    "dapo": {"epsilon_high": 0.28},
    "cispo": {"epsilon_high": 1.25},
    "sapo": {},
    "luspo": {},
    "vespo": {},
    "gpg": {},
    "gspo_token": {},
    "gmpo": {},
    "tic_grpo": {},
    "clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.0},  # every candidate cut: no random draw to differ
    "kl_cov": {"kl_cov_ratio": 0.5},
    "dppo_tv": {"epsilon": 0.05, "clip_ratio_c": 1.4},  # a trust region and a cap that act on the example
    "dppo_kl": {"epsilon": 0.05, "clip_ratio_c": 1.4},
    "dro": {"dro_beta": 0.5},
}
DETACHED_WEIGHT_TYPES = ("cispo", "vespo", "dppo_tv", "dppo_kl")


def gradcheck_inputs(seed: int = 0) -> dict:
    """float64 logits [2, 3, 7] and loss inputs with the ratios of RATIO (≥ 0.02 from 0.8, 1.2, 1.25, 1.28)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 7, generator=g, dtype=F64)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    mask = torch.tensor(MASK, dtype=torch.bool)
    with torch.no_grad():
        logp = gk.token_logprobs(logits, targets, mask=mask, backend="torch")
    old_logp = logp - torch.tensor(RATIO, dtype=F64).log()
    ref_logp = logp + torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.25, 0.0]], dtype=F64)
    advantages = torch.tensor(ADV, dtype=F64)
    return dict(logits=logits, targets=targets, mask=mask, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp)


def loss_fn(inputs: dict, on_policy: bool = False, **options):
    def f(logits):
        old_logp = None if on_policy else inputs["old_logp"]
        return gk.grpo_loss(
            logits,
            inputs["targets"],
            inputs["advantages"],
            old_logp,
            inputs["ref_logp"],
            inputs["mask"],
            backend="torch",
            inplace=False,
            beta=0.1,
            **{"use_bias_correction_kl": False, **options},  # on-policy, sg(ρ) ≡ 1 but its gradient is not 0
        ).loss

    return f


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", gk.LOSS_TYPES)
def test_gradcheck(loss_type, level):
    """Full grpo_loss (vocab pass + algebra) in float64: the analytic dL/dlogits matches finite differences."""
    if level == "sequence" and loss_type in TOKEN_LEVEL_ONLY_TYPES:  # they form their own sequence weight
        with pytest.raises(ValueError, match="importance_sampling_level"):
            LossOptions(loss_type=loss_type, importance_sampling_level="sequence")
        return
    inputs = gradcheck_inputs()
    options = dict(GRADCHECK_OPTIONS[loss_type], loss_type=loss_type, importance_sampling_level=level)
    logits = inputs["logits"].clone().requires_grad_()
    if loss_type in DETACHED_WEIGHT_TYPES:
        # Off-policy, the stop-gradient weight sg(min(ρ, ε_high)) / sg(φ(w)) still moves with logp under finite
        # differences (it is piecewise constant only where capped), so the numerical derivative sees its change and
        # the check must fail: that *is* TRL's semantics. On-policy (old_logp = logp.detach()) ρ ≡ 1 under any
        # perturbation, the weight is constant and gradcheck holds; off-policy gradients are checked against the
        # hand formula in test_detached_weight_gradient.
        assert not torch.autograd.gradcheck(loss_fn(inputs, **options), (logits,), raise_exception=False)
        assert torch.autograd.gradcheck(loss_fn(inputs, on_policy=True, **options), (logits,))
    else:
        assert torch.autograd.gradcheck(loss_fn(inputs, **options), (logits,))


def test_detached_weight_gradient():
    """cispo / vespo off-policy: dL/dlogits = g·(onehot − softmax), g = −w·A·c + β·w·(1 − e^{ref−logp}), w = 1/5."""
    inputs = gradcheck_inputs()
    softmax = inputs["logits"].softmax(-1)  # [B, T, V]
    onehot = torch.nn.functional.one_hot(inputs["targets"], 7).to(F64)  # [B, T, V]
    kl_grad = 1 - torch.exp(torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.25, 0.0]], dtype=F64))  # 1 − e^{ref−logp}
    adv = torch.tensor([[1.0], [-2.0]], dtype=F64)
    # cispo, ε_high = 1.25: c = min(ρ, 1.25) = [[1.25, 0.5, 1.1], [0.7, 1.25, ·]]
    # vespo: log w = ln(1.5·0.5·1.1) = ln 0.825 (A > 0: k = 2, λ = 3), ln(0.7·1.3) = ln 0.91 (A < 0: k = 3, λ = 2);
    #   φ = e^λ·w^k·e^(−λw)
    phi = [math.exp(3) * 0.825**2 * math.exp(-3 * 0.825), math.exp(2) * 0.91**3 * math.exp(-2 * 0.91)]
    weights = {"cispo": [[1.25, 0.5, 1.1], [0.7, 1.25, 0.0]], "vespo": [[phi[0]] * 3, [phi[1]] * 3]}
    for loss_type, c in weights.items():
        logits = inputs["logits"].clone().requires_grad_()
        loss_fn(inputs, **GRADCHECK_OPTIONS[loss_type], loss_type=loss_type)(logits).backward()
        g = (-adv * torch.tensor(c, dtype=F64) + 0.1 * kl_grad) / 5 * torch.tensor(MASK, dtype=F64)  # [B, T]
        expected = g[..., None] * (onehot - softmax)  # [B, T, V]
        torch.testing.assert_close(logits.grad, expected, rtol=1e-10, atol=1e-12, msg=loss_type)


# -------------------------------------------------------------------------------------------- registry


def test_registry():
    """Every registered loss type names a known normaliser and a paper; the registry is exactly LOSS_TYPES, and
    TRL's types keep TRL's normalisers."""
    assert set(gk.POLICY_LOSSES) == set(gk.LOSS_TYPES)
    assert len(gk.LOSS_TYPES) == len(set(gk.LOSS_TYPES))
    for name, spec in gk.POLICY_LOSSES.items():
        assert spec.name == name
        assert spec.normaliser in NORMALISERS, name
        assert isinstance(spec.paper, str) and spec.paper.strip(), name
        assert callable(spec.term) and callable(spec.clip_flags), name
    # TRL's `_compute_loss` aggregation per loss type
    trl = {
        "grpo": "sequence_mean",
        "sapo": "sequence_mean",
        "bnpo": "token_mean",
        "dr_grpo": "constant_length",
        "dapo": "item_mean",
        "cispo": "item_mean",
        "vespo": "item_mean",
        "luspo": "sequence_sum_mean",
    }
    assert {name: gk.POLICY_LOSSES[name].normaliser for name in trl} == trl

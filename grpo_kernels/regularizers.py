"""Extra loss terms and learned weights of the GRPO family, registered in `REGULARIZERS`.

Each one is plain, differentiable PyTorch on per-sequence or per-token tensors. Its output is an extra scalar loss
(AMIR-GRPO, DARO, Info-GRPO), `token_weights [B, T]` (TR-GRPO) or `sequence_weights [B]` (λ-GRPO), which the loss
engine multiplies into each token's loss. Formulas follow spec/variants.md §7, §8, §19, §21 and §22.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_kernels.checks import check_bool, check_float, check_shape, checked_floats
from grpo_kernels.groups import group_deviation, group_max, group_members, group_sum
from grpo_kernels.registry import Registry
from grpo_kernels.sampling import checked_batch

REGULARIZERS = Registry("regularizer")


# ------------------------------------------------------------------------------------------- AMIR-GRPO (§21)
def amir_pairs(
    rewards: Tensor,
    group_ids: Tensor,
    margin: float = 1.5,
    pair_mining: str = "all",
    max_pairs_per_group: int | None = None,
) -> tuple[Tensor, Tensor]:
    """AMIR-GRPO preference pairs: (chosen [K], rejected [K]) indices, same group, r_chosen − r_rejected > margin.

    `pair_mining="all"` takes every such pair; `"topk"` pairs the group's best response (the first in batch
    order on ties) with every other. `max_pairs_per_group` keeps each group's pairs with the largest reward gaps,
    ties in batch order. Pairs come out group by group. As in the reference code, spec §21.
    """
    rewards, index = checked_batch("rewards", rewards, group_ids)  # [B], [B]
    if pair_mining not in ("all", "topk"):
        raise ValueError(f"pair_mining must be 'all' or 'topk', got {pair_mining!r}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if max_pairs_per_group is not None and max_pairs_per_group < 1:
        raise ValueError(f"max_pairs_per_group must be >= 1 or None, got {max_pairs_per_group}")
    slots = group_members(index)  # [P, G] batch order within a group, −1 padding
    size = slots.shape[1]
    present = slots >= 0  # [P, G]
    r = torch.where(present, rewards[slots.clamp(min=0)], -math.inf)  # [P, G]
    gap = r[:, :, None] - r[:, None, :]  # [P, G, G] chosen × rejected
    ok = present[:, :, None] & present[:, None, :] & (gap > margin)  # [P, G, G]
    if pair_mining == "topk":
        ok &= (torch.arange(size, device=r.device) == r.argmax(1, keepdim=True))[:, :, None]
    if max_pairs_per_group is not None:
        ranked = torch.where(ok, gap, -math.inf).flatten(1).argsort(dim=1, descending=True, stable=True)  # [P, G·G]
        rank = torch.empty_like(ranked).scatter_(
            1, ranked, torch.arange(size * size, device=r.device).expand_as(ranked)
        )
        ok &= rank.view_as(ok) < max_pairs_per_group
    p, a, b = ok.nonzero(as_tuple=True)
    return slots[p, a], slots[p, b]


@REGULARIZERS.register("amir", paper="AMIR-GRPO, arXiv:2601.03661")
def amir_preference(
    logp_sum: Tensor,
    ref_logp_sum: Tensor | None,
    rewards: Tensor,
    group_ids: Tensor,
    beta: float = 0.2,
    lam: float = 0.01,
    margin: float = 1.5,
    pair_mining: str = "all",
    max_pairs_per_group: int | None = None,
) -> Tensor:
    """AMIR-GRPO in-group DPO term: λ · mean_pairs −log σ(β[(ℓ_i − ℓ^ref_i) − (ℓ_j − ℓ^ref_j)]) -> scalar.

    AMIR-GRPO (arXiv:2601.03661) adds L = L_GRPO + λ·L_pref. The pairs (i chosen, j rejected) are those of
    `amir_pairs`. ℓ is the *sum* of a completion's token log-probs: `logp_sum [B]` (differentiable) and
    `ref_logp_sum [B]`. `ref_logp_sum=None` is the reference code's ref-free mode (ℓ^ref ≡ 0), which is its
    default. Defaults β = 0.2, λ = 0.01, margin δ = 1.5 and "all" pairs are the code's, for rewards on a 2.0/0.0
    correctness scale. A batch without pairs gives 0, still attached to `logp_sum`'s graph. For the adaptive λ,
    call this with `lam=1.0` and weight the result with `AMIRLambda` (spec §21).
    """
    logp_sum = check_float("logp_sum", logp_sum)
    size = (len(logp_sum),)
    ref = torch.zeros_like(logp_sum) if ref_logp_sum is None else check_float("ref_logp_sum", ref_logp_sum, size)
    rewards = checked_floats("rewards", rewards, size)  # [B]
    chosen, rejected = amir_pairs(rewards, group_ids, margin, pair_mining, max_pairs_per_group)  # [K], [K]
    if chosen.numel() == 0:
        return logp_sum.sum() * 0.0
    implicit = logp_sum - ref.detach()  # [B] implicit reward ℓ − ℓ^ref
    z = beta * (implicit[chosen] - implicit[rejected])  # [K]
    return lam * -F.logsigmoid(z).mean()


@dataclass
class AMIRLambda:
    """AMIR-GRPO's adaptive λ: ×1.25 when λ·L_pref/L_GRPO < 0.3, ×0.8 when > 0.7, clamped to [0.005, 0.05].

    As in the reference code (`Train/trainer.py`, arXiv:2601.03661): the ratio divides by max(1e-9, L_GRPO), so a
    negative GRPO loss counts as a large ratio. λ is updated *before* mixing, so each step uses the new λ:
    `pref = amir_preference(..., lam=1.0)`, `lam = state.update(grpo_loss, pref)`, `loss = grpo + lam * pref`.
    """

    value: float = 0.01

    def update(self, grpo_loss: float | Tensor, pref_loss: float | Tensor) -> float:
        """Adapt λ from this step's GRPO loss and unweighted preference loss; returns the new λ."""
        ratio = self.value * float(pref_loss) / max(1e-9, float(grpo_loss))
        if ratio < 0.3:
            self.value = min(0.05, self.value * 1.25)
        elif ratio > 0.7:
            self.value = max(0.005, self.value * 0.8)
        return self.value


# ------------------------------------------------------------------------------------------------ DARO (§7)
def daro_bin_losses(loss_sums: Tensor, lengths: Tensor, bins: Tensor, num_bins: int) -> tuple[Tensor, Tensor]:
    """DARO's token-normalised loss per difficulty bin, L_μ = Σ_{i∈μ} Σ_t loss_{i,t} / Σ_{i∈μ} |o_i| -> [K], [K].

    `loss_sums [B]` are the per-sequence loss sums (the engine's per-sequence output), `lengths [B]` the token
    counts and `bins [B]` those of `sampling.daro_buckets` (−1 drops out). Also returns which bins hold tokens
    this step, [K] bool, for `DAROWeights`.
    """
    loss_sums = check_float("loss_sums", loss_sums)
    size = (len(loss_sums),)
    lengths = checked_floats("lengths", lengths, size, dtype=loss_sums.dtype)  # [B]
    bins = check_shape("bins", bins, size)
    if bins.is_floating_point() or (bins >= num_bins).any() or (bins < -1).any():
        raise ValueError(f"bins must be integers in [-1, num_bins) = [-1, {num_bins}), got {bins.tolist()}")
    kept = bins >= 0  # [B]
    sums = loss_sums.new_zeros(num_bins).index_add(0, bins[kept], loss_sums[kept])  # [K]
    tokens = loss_sums.new_zeros(num_bins).index_add(0, bins[kept], lengths[kept])  # [K]
    present = tokens > 0  # [K]
    return sums / torch.where(present, tokens, 1.0), present


@REGULARIZERS.register("daro", paper="DARO, arXiv:2510.09001")
class DAROWeights(nn.Module):
    """DARO learnable difficulty weights: Σ_μ [w_μ·L_μ − ln w_μ] with w_μ = softplus(u_μ) -> scalar.

    DARO (arXiv:2510.09001) learns one weight per pass-rate bin jointly with the policy, against the loss-scale
    imbalance of static μ-weights. The −ln w term comes from the community port, not the paper, so the weight rule
    is **unverified** (spec §7; one summary even describes DARO as up-weighting high-loss bins, which this
    inverse-loss form contradicts). A policy-gradient L_μ can be ≤ 0, and then −ln w has no finite optimum. So the
    w-gradient uses the positive proxy |L_μ| (detached): ∂/∂w_μ = |L_μ| − 1/w_μ, stationary at w*_μ = 1/|L_μ|,
    the plain gradient when L_μ > 0. The value and the policy gradient w_μ·∂L_μ are unchanged. Bins absent this
    step (`present` False) add nothing. `init` is the initial w.
    """

    def __init__(self, num_bins: int, init: float = 1.0) -> None:
        super().__init__()
        if num_bins < 1 or not init > 0:
            raise ValueError(f"DAROWeights needs num_bins >= 1 and init > 0, got num_bins={num_bins}, init={init}")
        self.u = nn.Parameter(torch.full((num_bins,), math.log(math.expm1(init))))  # [K] softplus(u) = init

    @property
    def weights(self) -> Tensor:
        """w_μ = softplus(u_μ) > 0, [K]."""
        return F.softplus(self.u)

    def forward(self, bin_losses: Tensor, present: Tensor | None = None) -> Tensor:
        """Σ_μ [w_μ·L_μ − ln w_μ] over the present bins, from `bin_losses [K]` (`daro_bin_losses`) -> scalar."""
        w = self.weights  # [K]
        bin_losses = check_float("bin_losses", bin_losses, tuple(w.shape), "K")
        loss = bin_losses.detach()  # [K]
        proxy = (w - w.detach()) * (loss.abs() - loss)  # [K] value 0; moves the w-gradient from L to |L|
        terms = w * bin_losses + proxy - torch.log(w)  # [K]
        if present is not None:
            terms = torch.where(check_bool("present", present, tuple(w.shape), "K"), terms, 0.0)  # [K]
        return terms.sum()


# ------------------------------------------------------------------------------------------- Info-GRPO (§22)
@REGULARIZERS.register("info_grpo", paper="Info-GRPO, OpenReview d5qElNtXS5 (unverified)")
def info_grpo(entropy: Tensor, mask: Tensor, augmented: Tensor, alpha: float = 1.0, lam: float = 0.1) -> Tensor:
    """Info-GRPO mutual-information term (unverified): −λ·[α·H(τ|q) − H(τ|q, z)] -> scalar loss to add.

    **Unverified** (spec §22: the paper was not found). This is the spec's most defensible form: each prompt has
    original rollouts T_ori ~ π(·|q) and augmented ones T_aug ~ π(·|q, z), `augmented [B]` marks the latter, and
    J = J_GRPO(T_ori ∪ T_aug) + λ·[α·H(τ|q) − H(τ|q, z)] raises I(τ; z). Each H is the mean over that set's
    sequences of the per-token mean of `entropy [B, T]` under `mask [B, T]`. Pass the full-vocabulary H_{i,t} from
    the kernel, or −logp for the sampled estimator. Community defaults α = 1, λ = 0.1 (unverified).
    """
    entropy = check_float("entropy", entropy, dims="B, T")
    mask = check_shape("mask", mask, tuple(entropy.shape), "B, T")
    augmented = check_bool("augmented", augmented, entropy.shape[:1])
    if augmented.all() or not augmented.any():
        raise ValueError("augmented must mark at least one original and one augmented sequence")
    mask = mask.to(entropy.dtype)
    per_sequence = (entropy * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return -lam * (alpha * per_sequence[~augmented].mean() - per_sequence[augmented].mean())


# ------------------------------------------------------------------------------------------------ TR-GRPO (§19)
@REGULARIZERS.register("tr_grpo", paper="TR-GRPO, arXiv:2511.00066")
def tr_grpo_weights(
    logp: Tensor, alpha: float = 2.0, tau: float = 9.0, mu: float = 0.25, low: float = 1.0, high: float = 1.4
) -> Tensor:
    """TR-GRPO token weights w = sg(clip(α·(σ(τ·p) − μ), L, U)), p = exp(logp) -> token_weights [B, T].

    TR-GRPO (arXiv:2511.00066) multiplies each token's surrogate and KL term by a monotone increasing, clipped
    shaping of its own probability: low-probability tokens, which have large gradients, weigh less. The weight is
    detached. The exact φ of the paper was not retrieved (spec §19, partial). We take the community constants with
    σ(τ·p): w rises from L = 1 (p ≲ 0.12) to U = 1.4 (p ≳ 0.33). The community composer's σ(p/τ), with τ = 9,
    clamps every weight to 1, a no-op. Its doc also claims high-probability tokens are down-weighted, the opposite
    of the paper (spec §26 item 5).
    """
    logp = check_float("logp", logp, dims="B, T")
    if not (tau > 0 and low <= high):
        raise ValueError(f"tr_grpo needs tau > 0 and low <= high, got tau={tau}, low={low}, high={high}")
    p = logp.detach().exp()  # [B, T]
    return (alpha * (torch.sigmoid(tau * p) - mu)).clamp(low, high)  # [B, T]


# ------------------------------------------------------------------------------------------------ λ-GRPO (§8)
@REGULARIZERS.register("lambda_grpo", paper="λ-GRPO, arXiv:2510.06870")
class LambdaGRPOWeights(nn.Module):
    """λ-GRPO learnable length preference: f_λ(o_i) = G·softmax_i((1 + r·z_i)^λ), z the in-group length z-score.

    λ-GRPO (arXiv:2510.06870) weighs each sequence's summed surrogate by f_λ(o_i), L = −(1/N_tok) Σ_i f_λ Σ_t s,
    with a learned scalar λ. z_i = (|o_i| − mean_G|o|)/(std_G|o| + ε), with the unbiased std (spec §0.2). λ = 0
    gives f ≡ 1 (DAPO); λ < 0 favours short outputs, λ > 0 long ones. Defaults λ_0 = 0 and r = 0.1111 come from the
    community port (unverified). A group of one, or of equal lengths, has z = 0 and f = 1. In large groups where
    1 + r·z ≤ 0, h is floored at 1e-6, as in the port. forward(lengths [B], group_ids [B]) -> sequence_weights [B],
    differentiable in λ.
    """

    def __init__(self, lam: float = 0.0, r: float = 0.1111, eps: float = 1e-6) -> None:
        super().__init__()
        if not (r > 0 and eps > 0):
            raise ValueError(f"LambdaGRPOWeights needs r > 0 and eps > 0, got r={r}, eps={eps}")
        self.lam = nn.Parameter(torch.tensor(float(lam)))
        self.r, self.eps = r, eps

    def forward(self, lengths: Tensor, group_ids: Tensor) -> Tensor:
        """f_λ(o_i) from the token counts `lengths [B]` and `group_ids [B]` -> sequence_weights [B]."""
        lengths, index = checked_batch("lengths", lengths, group_ids)  # [B], [B]
        size, centred, std = group_deviation(lengths.to(self.lam.dtype), index)  # [B] each; unbiased, 0 for one
        z = centred / (std + self.eps)  # [B]
        g = (1 + self.r * z).clamp(min=1e-6) ** self.lam  # [B]
        e = (g - group_max(g.detach(), index)).exp()  # [B]
        return size * e / group_sum(e, index)  # [B]

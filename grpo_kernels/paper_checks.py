"""What each registered component was checked against, and what remains unverified and why (docs/variants.md).

One entry per loss type, advantage estimator, reward, sampler and regularizer; `tests/test_variants_doc.py` fails
when a registered component has none. Labels (the spec's, §0.1): `V-code` (the official code, read at a pinned
commit), `V-paper` (the paper's page, abstract or a faithful summary), `V-ref` (a widely used reference
implementation: verl, TRL, ms-swift), `partial` (mechanism verified, some form or constant from a third-party port),
`unverified` (no primary source retrieved), `n/a` (a utility, not a paper's component). When the papers were
looked up again, only abstracts and first pages could be read, so a form that rests on a
port stays `partial` unless the readable text decides it (GTPO/GRPO-S normalisation, TIC-GRPO's advantage).
"""

from __future__ import annotations

from typing import NamedTuple

LABELS = ("V-code", "V-paper", "V-ref", "partial", "unverified", "n/a")
KINDS = ("loss type", "advantage", "reward", "sampler", "regularizer")


class Check(NamedTuple):
    status: str  # one of LABELS
    source: str  # what it was checked against: paper (version, equation, figure), official code path, reference
    gap: str  # what remains unverified and why ("" when nothing does)


CHECKS: dict[tuple[str, str], Check] = {
    # ---- loss types
    ("loss type", "bnpo"): Check("V-ref", "TRL 1.16 `loss_type='bnpo'`, run beside it in tests/test_trl.py", ""),
    ("loss type", "cispo"): Check(
        "V-ref",
        "verl `compute_policy_loss_cispo`, TRL's cispo; MiniMax-M1 (arXiv:2506.13585) abstract",
        "the paper's numeric ε_high was not re-read (0.28 is a framework default)",
    ),
    ("loss type", "clip_cov"): Check("V-ref", "verl `clip_cov` (core_algos.py)", "arXiv:2505.22617 not re-read"),
    ("loss type", "dapo"): Check("V-ref", "DAPO token-level loss (arXiv:2503.14476), verl `recipe/dapo`", ""),
    ("loss type", "dr_grpo"): Check(
        "V-ref", "Dr.GRPO (arXiv:2503.20783), sail-sg/understand-r1-zero recipe (constant = generation budget)", ""
    ),
    ("loss type", "dppo_kl"): Check(
        "V-ref",
        "verl 0.9.1 `compute_policy_loss_dppo_kl`, run beside it in tests/test_verl.py; DPPO (arXiv:2602.04879v1) "
        "abstract: masks from a binary approximation of the policy divergence replace PPO's ratio clip",
        "only the abstract and figure captions could be read: the binary KL's form, its thresholds and the "
        "truncation cap (verl: clip_ratio_c, 20 where the config lacks it) are verl's",
    ),
    ("loss type", "dppo_tv"): Check(
        "V-ref",
        "verl 0.9.1 `compute_policy_loss_dppo_tv`, run beside it in tests/test_verl.py; DPPO (arXiv:2602.04879v1) "
        "abstract and Fig. 2 caption (a TV-based mask instead of the ratio's)",
        "only the abstract and figure captions could be read: the thresholds and the truncation cap are verl's",
    ),
    ("loss type", "dro"): Check(
        "V-ref",
        "verl 0.9.1 `compute_policy_loss_dro`, run beside it in tests/test_verl.py; Tinker's DRO loss documentation "
        "(objective log p·A − ½β(log p/q)², after Richemond et al., arXiv:2405.19107, and Kimi k1.5, "
        "arXiv:2501.12599)",
        "neither paper was read: the per-token form with q = the old policy is verl's and Tinker's",
    ),
    ("loss type", "gmpo"): Check("V-ref", "verl `geo_mean` loss", "GMPO's paper (arXiv:2507.20673) not re-read"),
    ("loss type", "gpg"): Check("V-code", "GPG eq. 5; AMAP-ML/GPG @ e096da8c `open-r1/src/open_r1/gpg_trainer.py`", ""),
    ("loss type", "grpo"): Check(
        "V-ref",
        "DeepSeekMath (arXiv:2402.03300) GRPO objective; verl / TRL",
        "DeepSeekMath's ε = 0.2 and β = 0.04 are recalled, not re-read",
    ),
    ("loss type", "gspo_token"): Check("V-ref", "GSPO (arXiv:2507.18071) eq. 13; verl `compute_policy_loss_gspo`", ""),
    ("loss type", "kl_cov"): Check("V-ref", "verl `kl_cov` (core_algos.py)", "arXiv:2505.22617 not re-read"),
    ("loss type", "luspo"): Check("unverified", "—", "arXiv:2602.05261 was not retrieved in any pass"),
    ("loss type", "sapo"): Check("V-ref", "verl / ms-swift / AReaL SAPO gate, τ_pos = 1, τ_neg = 1.05", ""),
    ("loss type", "tic_grpo"): Check(
        "partial",
        "TIC-GRPO abstract (arXiv:2508.02833v5): one trajectory-level ratio replaces the token ratios",
        "clip widths and the objective's equation: only the abstract could be read",
    ),
    ("loss type", "vespo"): Check("unverified", "—", "arXiv:2602.10693 was not retrieved in any pass"),
    # ---- advantage estimators
    ("advantage", "dr_grpo"): Check("V-ref", "Dr.GRPO (arXiv:2503.20783); verl `norm_adv_by_std_in_grpo=False`", ""),
    ("advantage", "gdpo"): Check("V-code", "NVlabs/GDPO @ b080e63d, README code excerpts (TRL and verl)", ""),
    ("advantage", "grpo"): Check("V-ref", "DeepSeekMath outcome supervision (arXiv:2402.03300); verl / TRL", ""),
    ("advantage", "grpo_lead"): Check(
        "V-code", "aeroplanepaper/GRPO-LEAD @ 9344bef7 `verl/verl/trainer/ppo/core_algos.py` (logistic reweight)", ""
    ),
    ("advantage", "grpo_s"): Check(
        "partial",
        "arXiv:2508.04349v6 abstract and Fig. 1: correct sequences with higher mean entropy rewarded, incorrect "
        "paths penalised",
        "the sequence-level equation and its normalisation were not retrievable; group-wide standardisation is "
        "used because it matches Fig. 1 (the port's within-O± form is normalize='split'); α₁ = 1, α₂ = 0.1 per "
        "the port",
    ),
    ("advantage", "gtpo"): Check(
        "partial",
        "arXiv:2508.04349v6 abstract (ratios H_{i,t}/Σ_k H_{k,t}) and Fig. 1: high-entropy tokens rewarded in correct "
        "sequences, suppressed in incorrect ones",
        "the token-reward equations come from a port citing the paper's Eqs. 3, 5, 6; its within-O± standardisation "
        "gives correct tokens negative advantages, against Fig. 1, so the group is the default scope; α's per the port",
    ),
    ("advantage", "krpo"): Check("V-code", "billhhh/KRPO_LLMs_RL @ df1ae2b9 `train.py` (KalmanFilter)", ""),
    ("advantage", "ms_grpo"): Check(
        "partial", "OpenReview ktHj6YazEE abstract", "scales, subgroups per scale and their weights: community defaults"
    ),
    ("advantage", "pvpo"): Check(
        "V-paper", "PVPO (arXiv:2508.21104) A = r − V̂ from paper summaries", "M and the refresh schedule of V̂"
    ),
    ("advantage", "rank_grpo"): Check(
        "partial", "RLRR (arXiv:2601.23058) mechanism", "formulas from the community port; ξ⁻ = ξ⁺ = 0 are ours"
    ),
    ("advantage", "reinforce_pp"): Check("V-ref", "verl REINFORCE++-baseline advantage (global whitening)", ""),
    ("advantage", "rloo"): Check("V-ref", "RLOO (arXiv:2402.14740); verl / ms-swift leave-one-out", ""),
    ("advantage", "stratified"): Check("V-paper", "Stratified GRPO (arXiv:2510.06214) SAN", ""),
    ("advantage", "tic_grpo"): Check(
        "unverified",
        "a community port only (group z-score of r/|o|)",
        "not in the paper's abstract (v5), which keeps GRPO's group-normalised rewards; the tic_grpo preset uses grpo",
    ),
    ("advantage", "xrpo"): Check(
        "partial",
        "XRPO abstract (arXiv:2510.06672v3): group-relative novelty sharpening from sequence likelihoods",
        "the bonus form and λ = κ = 1 come from the community port; the official code (UIUC-MLSys/XRPO) is not "
        "retrievable here",
    ),
    # ---- rewards
    ("reward", "countdown"): Check("V-ref", "TinyZero Countdown reward", ""),
    ("reward", "dapo_overlong"): Check("V-ref", "DAPO soft overlong punishment (arXiv:2503.14476); verl recipe", ""),
    ("reward", "dra_diversity"): Check(
        "V-code",
        "xiwenc1/DRA-GRPO @ 08826616 `grpo_trainer.py` SMI block",
        "sums within the group; the code sums over the device's completions",
    ),
    ("reward", "format"): Check("V-ref", "DeepSeek-R1 format reward (arXiv:2501.12948)", "the exact pattern is ours"),
    ("reward", "gapo_frequency"): Check(
        "partial", "GAPO (arXiv:2511.12596) mechanism", "the equation from a port that follows the paper; no code"
    ),
    ("reward", "gdpo_multi"): Check("V-code", "NVlabs/GDPO @ b080e63d README", ""),
    ("reward", "grpo_lead_length"): Check(
        "V-code", "aeroplanepaper/GRPO-LEAD @ 9344bef7 `verl/verl/trainer/main_ppo.py` (length reweight)", ""
    ),
    ("reward", "gsm8k"): Check("V-ref", "GSM8K (arXiv:2110.14168) final-number answers", ""),
    ("reward", "math_answer"): Check("V-ref", "DeepSeek-R1 rule-based accuracy reward; math-verify", ""),
    ("reward", "p_grpo_posterior"): Check(
        "partial", "Posterior-GRPO (arXiv:2508.05170) mechanism", "R_think's weighting was not retrieved"
    ),
    ("reward", "rank_grpo"): Check("partial", "RLRR (arXiv:2601.23058) mechanism", "modes and τ = 0.1 from the port"),
    ("reward", "spo_trajectory"): Check(
        "partial", "SPO (arXiv:2505.11595) mechanism", "β = 5, γ = 0.5 are community constants (sign corrected)"
    ),
    ("reward", "unlikeliness"): Check(
        "V-code", "AndreHe02/rewarding-unlikely-release @ ca1cff05 `ray_lean_trainer.py` (rank penalty)", ""
    ),
    ("reward", "weighted_sum"): Check("n/a", "a plain weighted sum of rule rewards", ""),
    # ---- samplers
    ("sampler", "dapo_dynamic"): Check("V-ref", "DAPO dynamic sampling (0 < #correct < G); verl `recipe/dapo`", ""),
    ("sampler", "daro_buckets"): Check("partial", "DARO (arXiv:2510.09001) mechanism", "the bin count is ours"),
    ("sampler", "gpg_valid"): Check("V-code", "AMAP-ML/GPG @ e096da8c `gpg_trainer.py` (B_valid, resampling)", ""),
    ("sampler", "pvpo_filter"): Check(
        "V-paper", "PVPO (arXiv:2508.21104) summaries", "how injected ground-truth trajectories are weighted"
    ),
    ("sampler", "xrpo_allocate"): Check(
        "partial",
        "XRPO abstract (v3) and a review of the paper: Student-t half-width h_q = t_{1−α/2, n−1}·s_q/√n",
        "the paper allocates hierarchically over rounds and seeds zero-reward prompts with curated exemplars; here "
        "one allocation round and no seeding (no exemplar pool ships); the bonus c·√(ln N / n) and α = 0.05 are the "
        "spec's reading",
    ),
    # ---- regularizers
    ("regularizer", "amir"): Check("V-code", "AmirHosseinYari2002/AMIR-GRPO @ 56f45274 `Train/trainer.py`", ""),
    ("regularizer", "daro"): Check(
        "partial", "DARO (arXiv:2510.09001) mechanism", "the −ln w term and the weight update come from the port"
    ),
    ("regularizer", "info_grpo"): Check("unverified", "a community port", "the paper was not found"),
    ("regularizer", "lambda_grpo"): Check(
        "partial", "λ-GRPO (arXiv:2510.06870) paper page", "λ₀ = 0, r = 0.1111 and λ's learning rate from the port"
    ),
    ("regularizer", "tr_grpo"): Check(
        "partial",
        "TR-GRPO abstracts (arXiv:2511.00066 v1, v2): a monotone shaping of the token's own probability that "
        "down-weights low-probability tokens",
        "the exact φ and its constants come from the port, read as σ(τ·p) (the port's σ(p/τ) weighs every token 1)",
    ),
}

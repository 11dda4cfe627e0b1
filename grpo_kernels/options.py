"""LossOptions: every loss option once, with TRL 1.16's name and default where TRL has the option.

Deliberate differences from TRL's `GRPOConfig` defaults (`TRL_DEFAULT_DIFFERENCES`; `tests/test_trl_names.py`
fails when TRL drifts from this list): `max_completion_length` is None here, because the loss never sees the
generation settings, so `loss_type="dr_grpo"` asks for it instead of assuming TRL's 512; `min_p` is 0.0 (off, as
vLLM's default) where TRL's off is None.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import warnings
from dataclasses import dataclass

import torch

from grpo_kernels.distillation import as_teacher_divergence
from grpo_kernels.kernels.divergence import DivergenceOptions
from grpo_kernels.option_checks import OPTION_RULES, check_option, type_words
from grpo_kernels.rollout_correction import RolloutCorrection, as_rollout_correction
from grpo_kernels.shown import shown

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LOSS_TYPES = (
    *TRL_LOSS_TYPES,
    "gpg",
    "gspo_token",
    "gmpo",
    "tic_grpo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "dro",
)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
CLIPPED_SURROGATE_TYPES = (*CLIP_LOSS_TYPES, "gspo_token", "tic_grpo")  # where delta and clip_ratio_c act
DPPO_TYPES = ("dppo_tv", "dppo_kl")  # divergence trust regions; clip_ratio_c caps their IS weight (truncated IS)
TOKEN_LEVEL_ONLY_TYPES = ("vespo", "gspo_token", "tic_grpo")  # they form their own sequence weight
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
_EPSILON_DEFAULT = 0.2
# TRL 1.16 GRPOConfig defaults this project keeps different on purpose (name -> (ours, TRL's, why)); see the docstring
TRL_DEFAULT_DIFFERENCES = {
    "max_completion_length": (None, 512, "the loss never sees the generation settings: dr_grpo asks for it"),
    "min_p": (0.0, None, "off is 0.0, vLLM's SamplingParams default: one type; TRL's None (off) reads as 0.0"),
}
CISPO_EPSILON_HIGH = 5.0  # the IS-weight cap CISPO is run with: ScaleRL's ε_max (arXiv:2510.13786), TRL's advice
_warned: set[str] = set()  # warnings given once per process


class CISPOCapWarning(UserWarning):
    """`loss_type="cispo"` (one-sided, TRL's) with an IS-weight cap below 1: every token's gradient is scaled down."""


LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossOptions:
    """Hyperparameters of the GRPO loss family; validated on construction."""

    loss_type: str = "dapo"  # TRL's loss types: the per-token loss and its normaliser (TRL's default: dapo)
    epsilon: float = 0.2  # clip range low width: ratio >= 1 - epsilon (TRL's name)
    epsilon_high: float | None = None  # clip range high width (None = epsilon); cispo: absolute IS-weight cap
    delta: float | None = None  # two-sided clipping: cap of the unclipped ratio (INTELLECT-2, arXiv:2505.07291)
    beta: float = 0.0  # coefficient of the k3 KL(pi || pi_ref) penalty; needs ref_logp when non-zero
    temperature: float = 1.0  # logits are divided by it before the softmax
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO, arXiv:2507.18071)
    max_completion_length: int | None = None  # dr_grpo's constant normaliser (arXiv:2503.20783)
    num_items_in_batch: float | torch.Tensor | None = None  # dapo/cispo/vespo normaliser Z, used as given (a value
    # in (0, 1) scales the token sum up, as TRL's rescaled count does); None = mask.sum(), at least 1; a tensor must
    # be > 0 too, read with the loss's value checks (check_finite=True), unchecked without them
    sapo_temperature_pos: float = 1.0  # SAPO gate temperature for A > 0 (arXiv:2511.20347)
    sapo_temperature_neg: float = 1.05  # SAPO gate temperature for A <= 0
    use_bias_correction_kl: bool = True  # KL term multiplied by the unclipped IS ratio (DeepSeek-V3.2; TRL: True)
    vespo_k_pos: float = 2.0  # VESPO gamma shape for A >= 0
    vespo_lambda_pos: float = 3.0  # VESPO gamma rate for A >= 0
    vespo_k_neg: float = 3.0  # VESPO gamma shape for A < 0
    vespo_lambda_neg: float = 2.0  # VESPO gamma rate for A < 0
    top_entropy_quantile: float = 1.0  # keep only tokens in the top entropy quantile (arXiv:2506.01939)
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences whose mean KL(sampler || π) exceeds it
    kl_estimator: str = "k3"  # k1, k2, k3 (TRL's), low_var_kl (k3 clamped to ±10) or abs (|logp − ref|), verl's
    clip_ratio_c: float | None = None  # dual-clip PPO: loss capped at −A·c where A < 0 (arXiv:1912.09729), > 1;
    # dppo_tv / dppo_kl: cap of their detached IS weight (truncated IS), > 0; None: no cap
    cispo_two_sided: bool = False  # cispo weight clip(ρ, 1 − ε_low, 1 + ε_high) instead of TRL's min(ρ, ε_high)
    entropy_coef: float = 0.0  # entropy bonus: loss − coef · mean entropy of the kept tokens (TRL semantics)
    loss_agg_mode: str | None = None  # verl's aggregation, overriding the loss type's normaliser (None: keep it)
    num_sequences_in_batch: float | torch.Tensor | None = None  # seq-mean modes' sequence count; None: this batch's
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant; None: T (verl's default)
    logit_scale: float = 1.0  # logits multiplied by it first (Cohere, Granite's 1/logits_scaling; TRL's name)
    final_logit_softcapping: float | None = None  # then c·tanh(z/c) before the temperature (Gemma 2/3; TRL's name)
    top_k: int = 0  # sampling replay: log-probs over the sampler's top-k of logits / T (0: off; TRL's and vLLM's name)
    top_p: float = 1.0  # sampling replay: ... over its nucleus of mass top_p, after top-k (1.0: off)
    min_p: float = 0.0  # sampling replay: ... over tokens with q >= min_p · max q, first (0.0: off; vLLM's order)
    replay_entropy: str = "support"  # with replay, the entropy of the sampler's support or of the "full" vocabulary
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of kept tokens whose gradient is cut (arXiv:2505.22617)
    clip_cov_lb: float = 1.0  # clip_cov: candidates have a batch covariance in (clip_cov_lb, clip_cov_ub)
    clip_cov_ub: float = 5.0  # clip_cov: the window's upper bound (verl's defaults for all three)
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of kept tokens, the largest covariances, that get the penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of |logp − old_logp| on those tokens (verl's config default)
    dro_beta: float | None = None  # dro: coefficient β of the penalty ½β(logp − old_logp)²; required (> 0) for dro
    epsilon_low: float | None = None  # verl-style alias of `epsilon`: moved into it on construction, then None
    rollout_correction: RolloutCorrection | None = None  # the sampler-mismatch correction (docs/mismatch.md): a
    # RolloutCorrection, a mapping of its fields, or a verl preset name (bypass_ppo_clip, decoupled_k3_rs, ...)
    teacher_kl_coef: float = 0.0  # on-policy distillation in the GRPO step: coef · the divergence from a teacher
    # (fused_linear_grpo_loss's teacher_hidden / teacher_weight), each token weighed as the loss weighs its own; 0: off
    teacher_divergence: DivergenceOptions | None = None  # the teacher term's divergence: a mapping of beta (0 forward
    # KL, 1 reverse KL, else JSD), temperature, teacher_logit_scale, teacher_final_logit_softcapping, top_k, as in
    # fused_linear_divergence (none: its defaults, reverse KL at temperature 1)

    def __post_init__(self) -> None:
        given = self.rollout_correction
        try:
            correction, needed_loss = as_rollout_correction(given)
        except (TypeError, ValueError) as error:
            raise type(error)(
                str(error) if str(error).startswith("rollout_correction") else f"rollout_correction: {error}"
            ) from None
        object.__setattr__(self, "rollout_correction", correction)
        object.__setattr__(self, "teacher_divergence", as_teacher_divergence(self.teacher_divergence))
        if needed_loss is not None and self.loss_type != needed_loss:
            raise ValueError(
                f"rollout_correction preset {shown(given)} is verl's REINFORCE: it needs "
                f"loss_type={needed_loss!r}, got loss_type={self.loss_type!r}"
            )
        _check_types(self)
        if self.epsilon_low is not None:
            if self.epsilon not in (_EPSILON_DEFAULT, self.epsilon_low):
                raise ValueError(
                    f"epsilon_low is an alias of epsilon: give one, got epsilon={self.epsilon}, "
                    f"epsilon_low={self.epsilon_low}"
                )
            object.__setattr__(self, "epsilon", self.epsilon_low)
            object.__setattr__(self, "epsilon_low", None)
        self._validate()
        if self.loss_type == "cispo" and not self.cispo_two_sided and self.clip_high < 1.0:
            _warn_once(
                "cispo_cap",
                f"loss_type='cispo' caps every token's IS weight at {self.clip_high} (epsilon_high, or epsilon when "
                "it is None, as in TRL): below 1, even on-policy tokens are scaled down. CISPO is run with a cap well "
                f"above 1: epsilon_high = {CISPO_EPSILON_HIGH} (ScaleRL's, arXiv:2510.13786, as TRL recommends; "
                "MiniMax-M1, arXiv:2506.13585, tunes only the upper bound), or the `cispo` preset",
                CISPOCapWarning,
            )

    def _validate(self) -> None:
        _check_choice("loss_type", self.loss_type, LOSS_TYPES)
        _check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if not self.beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        _check_positive("sapo_temperature_pos", self.sapo_temperature_pos)
        _check_positive("sapo_temperature_neg", self.sapo_temperature_neg)
        if not 0.0 <= self.epsilon:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.epsilon_high is not None and not 0.0 <= self.epsilon_high:
            raise ValueError(f"epsilon_high must be >= 0 or None, got {self.epsilon_high}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("replay_entropy", self.replay_entropy, ("support", "full"))
        if self.loss_agg_mode is not None:
            _check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        for name, types in (("delta", CLIPPED_SURROGATE_TYPES), ("clip_ratio_c", CLIPPED_SURROGATE_TYPES + DPPO_TYPES)):
            if getattr(self, name) is not None and self.loss_type not in types:
                raise ValueError(f"{name} applies to loss_type in {types}, got loss_type={self.loss_type!r}")
        if self.delta is not None:
            _check_positive("delta", self.delta)
        if self.clip_ratio_c is not None and self.loss_type in DPPO_TYPES:
            _check_positive("clip_ratio_c", self.clip_ratio_c)  # the truncation cap of the IS weight
        elif self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip), got {self.clip_ratio_c}")
        if self.dro_beta is not None and self.loss_type != "dro":
            raise ValueError(f"dro_beta applies to loss_type='dro', got loss_type={self.loss_type!r}")
        if self.loss_type == "dro" and not (self.dro_beta is not None and self.dro_beta > 0):
            raise ValueError(f"loss_type='dro' needs dro_beta > 0, got {self.dro_beta}")
        if self.cispo_two_sided and self.loss_type != "cispo":
            raise ValueError(f"cispo_two_sided applies to loss_type='cispo', got loss_type={self.loss_type!r}")
        if self.loss_scale_factor is not None:
            _check_positive("loss_scale_factor", self.loss_scale_factor)
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise ValueError(f"off_policy_mask_threshold must be >= 0 or None, got {self.off_policy_mask_threshold}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got ({self.clip_cov_lb}, {self.clip_cov_ub})")
        if not self.teacher_kl_coef >= 0.0:
            raise ValueError(f"teacher_kl_coef must be >= 0, got {self.teacher_kl_coef}")
        if not self.ppo_kl_coef >= 0.0:
            raise ValueError(f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")
        if self.loss_type == "dr_grpo":
            if self.max_completion_length is None or self.max_completion_length <= 0:
                raise ValueError(
                    f"loss_type='dr_grpo' needs max_completion_length > 0, got {self.max_completion_length}"
                )
        if self.loss_type in TOKEN_LEVEL_ONLY_TYPES and self.importance_sampling_level != "token":
            raise ValueError(
                f"loss_type={self.loss_type!r} forms its own sequence weight: importance_sampling_level must be 'token'"
            )

    @property
    def clip_high(self) -> float:
        """The high clip width (epsilon_high, or epsilon when it is None, as in TRL)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_kwargs(cls, **kwargs) -> LossOptions:
        """Build from keyword arguments; an unknown name is a TypeError listing the valid ones."""
        names = OPTION_NAMES
        unknown = sorted(map(str, set(kwargs) - names))
        if unknown:
            first = unknown[:SHOWN_NAMES]  # a hint for each of the first few only: bounded work and message
            hints = [f"{shown(name)}: did you mean {close[0]!r}?" for name in first if (close := _closest(name, names))]
            hint = f" ({'; '.join(hints)})" if hints else ""
            raise TypeError(f"unknown loss option(s) {some_names(unknown)}{hint}; valid options are {sorted(names)}")
        check_epsilon_names(kwargs)
        return cls(**kwargs)


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LossOptions))  # a constant: compiled code reads it
SHOWN_NAMES = 5  # unknown names an error lists (then their count)


def some_names(names: list[str]) -> str:
    """The first `SHOWN_NAMES` of `names` (each bounded by `shown`) and, when there are more, how many in all."""
    listed = ", ".join(shown(name) for name in names[:SHOWN_NAMES])
    return f"[{listed}]" + (
        f" (and {len(names) - SHOWN_NAMES} more, {len(names)} in all)" if len(names) > SHOWN_NAMES else ""
    )


def _closest(name: str, names: set[str]) -> list[str]:
    """The valid name closest to a misspelt `name` (difflib), as a list of at most one."""
    return difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)


def check_epsilon_names(given: dict) -> None:
    """`epsilon` and its alias `epsilon_low` both given (by name: keywords, a config file, flags) with different
    values is a ValueError; LossOptions itself cannot tell an explicit `epsilon=0.2` from the default."""
    if "epsilon" in given and given.get("epsilon_low") is not None and given["epsilon"] != given["epsilon_low"]:
        raise ValueError(
            "epsilon_low is an alias of epsilon: give one, got "
            f"epsilon={shown(given['epsilon'])}, epsilon_low={shown(given['epsilon_low'])}"
        )


def resolve_options(options, loss_options: dict) -> LossOptions:
    """A call's LossOptions: `options=` (a LossOptions, or a paper preset, whose `.loss` it takes) or keywords."""
    if options is None:
        if any(isinstance(value, torch.Tensor) for value in loss_options.values()):
            return LossOptions.from_kwargs(**loss_options)
        try:
            named = sorted(loss_options.items(), key=lambda item: item[0])  # by name: a record value has no order
            return _options_of(tuple((name, type(value), value) for name, value in named))
        except TypeError as error:  # an unhashable value (a list...): built, not cached
            if "unhashable" not in str(error):
                raise
            return LossOptions.from_kwargs(**loss_options)
    options = getattr(options, "loss", options)  # a presets.Preset
    if not isinstance(options, LossOptions):
        raise TypeError(f"options must be a LossOptions or a preset, got {type(options).__name__}")
    if loss_options:
        raise TypeError(
            f"pass loss options either as options=LossOptions(...) or as keywords, not both: {shown(loss_options)}"
        )
    return options


@functools.lru_cache(maxsize=256)
def _options_of(items: tuple) -> LossOptions:
    """LossOptions of keyword items (name, type, value), built (and validated) once per distinct set: a call's
    options are frozen, and the same keywords come again every step. The type is part of the key, so that `1` and
    `1.0` or `True` (equal, of one hash) are each validated as given."""
    return LossOptions.from_kwargs(**{name: value for name, _, value in items})


def _warn_once(key: str, message: str, category: type[Warning]) -> None:
    """`warnings.warn` the first time `key` comes up in this process only (a LossOptions is rebuilt every step)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=4)


_POSITIVE = (  # the options that must be > 0 (their non-finite values are refused saying so)
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "delta",
    "loss_scale_factor",
    "num_items_in_batch",
    "num_sequences_in_batch",
)


def _check_types(options: LossOptions) -> None:
    """A TypeError naming the first option whose type is not its field's (an int is a float too; a bool is
    neither), a ValueError for a float that is NaN or ±inf: checked before any range, so that no comparison with a
    string, None or NaN decides. A tensor normaliser is checked with the loss's values (`check_finite`). The options
    the public functions and the drop-ins take too are checked by `option_checks`, type and range, one message each."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name in OPTION_RULES:
            check_option(f.name, value)
            continue
        allowed = {part.strip() for part in f.type.split("|")}
        if value is None and "None" in allowed or isinstance(value, torch.Tensor) and "torch.Tensor" in allowed:
            continue
        if allowed & {"RolloutCorrection", "DivergenceOptions"}:  # records, converted and validated on construction
            continue
        if isinstance(value, bool):
            ok = "bool" in allowed
        elif isinstance(value, int):
            ok = bool(allowed & {"int", "float"})
        else:
            ok = any(isinstance(value, kind) for kind in (str, float) if kind.__name__ in allowed)
        if not ok:
            kinds = sorted(allowed - {"None"}, key=("bool", "int", "float", "str", "torch.Tensor").index)
            expected = " or ".join(type_words(kind) for kind in kinds) + (" or None" if "None" in allowed else "")
            raise TypeError(f"{f.name} must be {expected}, got {type(value).__name__} {shown(value)}")
        if f.name in ("num_items_in_batch", "num_sequences_in_batch") and not value > 0:  # NaN too
            raise ValueError(f"{f.name} must be > 0, got {value}")
        if isinstance(value, float) and not math.isfinite(value):
            rule = "> 0 and finite" if f.name in _POSITIVE else "finite"
            raise ValueError(f"{f.name} must be {rule}, got {value}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {shown(value)}")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")

"""RolloutCorrection: one record for every correction of the sampler–trainer mismatch (LossOptions.rollout_correction).

The sampler (vLLM) and the trainer never compute the same log-probs, and the sampler may lag. The frameworks correct
this with importance-sampling (IS) weights, rejection of outlying tokens or sequences, or both; this record holds all
of them, under verl's names (`RolloutCorrectionConfig`) where verl has the concept:

- IS weights π_train / π_sampler at `rollout_is` level ("token" or "sequence"), bounded by `rollout_is_threshold`:
  a float truncates them (TIS; `rollout_is_threshold_lower`, when given, is a floor), a verl "lower_upper" string or
  `rollout_is_bounds="mask"` zeroes those outside [lower, upper] (IcePop); `rollout_is_batch_normalize` rescales
  them to mean 1 over the batch.
- Rejection (`rollout_rs`, comma-combined statistics with per-statistic `rollout_rs_threshold`s, verl's
  `"0.5_2.0,0.01"` form): a rejected token or sequence leaves the loss mask (and its normaliser).
- `bypass_mode`: π_old is the sampler's (old_logp := sampling_logp) and π_train is the policy itself (verl's
  bypass); otherwise π_train is π_old (decoupled, three policies).
- `geo_mask`: NeMo RL's seq-mask-tis sequence mask, exp(mean_t log r) within "lower_upper" (weights zeroed, the
  normaliser kept); `ipo_threshold` and `log_ratio_penalty`: prime-rl's IPO mask |p_θ − p_μ| > ε (policy term
  dropped) and its τ·(log π_θ − log π_μ)² term on every kept token.
- `log_ratio_bound`: the log-ratio is clamped to ±bound before exp (verl's 20); None keeps TRL's unclamped ratio.

TRL's four `vllm_importance_sampling_mode`s are `from_trl(mode, clip_min, clip_max)`; verl's presets `VERL_PRESETS`.
The math is `losses/mismatch.py`; docs/mismatch.md compares the frameworks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from grpo_kernels.shown import shown

IS_LEVELS = ("token", "sequence")
IS_BOUNDS = ("truncate", "mask")
RS_STATISTICS = (  # verl's rejection statistics (rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS)
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
SAFETY_BOUND = 20.0  # verl's clamp of the log-ratio before exp
TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class RejectionRule:
    """One rejection statistic and its bounds: k1 statistics take ratio bounds [lower, upper] (compared in log
    space, as verl does), k2 / k3 an upper bound on the divergence (`lower` None)."""

    statistic: str
    lower: float | None
    upper: float


@dataclass(frozen=True)
class RolloutCorrection:
    """The sampler-mismatch correction of a loss call; validated on construction (each error names the field)."""

    rollout_is: str | None = None  # IS weight level: "token", "sequence", or None (no weights)
    rollout_is_threshold: float | str | None = 2.0  # upper bound, or verl's "lower_upper" (IcePop); None: no bound
    rollout_is_threshold_lower: float | None = None  # truncate: a floor (TRL's clip_min); mask: the lower bound
    rollout_is_bounds: str = "truncate"  # "truncate" (TIS: clamp) or "mask" (IcePop: 0 outside the bounds)
    rollout_is_batch_normalize: bool = False  # weights divided by their batch mean (verl)
    rollout_rs: str | None = None  # rejection statistics, comma-separated (RS_STATISTICS)
    rollout_rs_threshold: float | str | None = None  # one per statistic (or one for all): "lower_upper" for k1
    bypass_mode: bool = False  # π_old := the sampler's; π_train := the policy (verl's bypass)
    geo_mask: str | None = None  # NeMo's seq-mask-tis: keep sequences with exp(mean log r) in "lower_upper"
    ipo_threshold: float | None = None  # prime-rl IPO: drop the policy term where |p_θ − p_sampler| > ε
    log_ratio_penalty: float = 0.0  # prime-rl's τ: + τ·(logp − sampling_logp)² on every kept token
    log_ratio_bound: float | None = SAFETY_BOUND  # |log r| clamp before exp (verl's 20); None: unclamped (TRL)
    rules: tuple[RejectionRule, ...] = field(default=(), init=False, repr=False, compare=False)
    geo_bounds: tuple[float, float] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_choice("rollout_is", self.rollout_is, (*IS_LEVELS, None))
        _check_choice("rollout_is_bounds", self.rollout_is_bounds, IS_BOUNDS)
        upper, lower = self.rollout_is_threshold, self.rollout_is_threshold_lower
        if isinstance(upper, str):  # verl's spec: "2.0" (TIS) or "0.5_5.0" (IcePop)
            parsed_lower, upper = _parse_bounds("rollout_is_threshold", upper)
            if parsed_lower is not None:
                if lower is not None and lower != parsed_lower:
                    raise ValueError(
                        f"rollout_is_threshold {shown(self.rollout_is_threshold)} gives the lower bound: "
                        f"rollout_is_threshold_lower must be None, got {lower}"
                    )
                lower = parsed_lower
                object.__setattr__(self, "rollout_is_bounds", "mask")
            object.__setattr__(self, "rollout_is_threshold", upper)
            object.__setattr__(self, "rollout_is_threshold_lower", lower)
        for name in ("rollout_is_threshold", "rollout_is_threshold_lower", "ipo_threshold", "log_ratio_bound"):
            _check_positive_or_none(name, getattr(self, name))
        if upper is not None and lower is not None and not lower <= upper:
            raise ValueError(f"rollout_is_threshold_lower must be <= rollout_is_threshold, got {lower} > {upper}")
        for name in ("rollout_is_batch_normalize", "bypass_mode"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {shown(getattr(self, name))}")
        penalty = self.log_ratio_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0.0 <= penalty < math.inf:
            raise ValueError(f"log_ratio_penalty must be a finite float >= 0, got {shown(penalty)}")
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("rollout_is_batch_normalize needs rollout_is ('token' or 'sequence'), got None")
        object.__setattr__(self, "rules", _parse_rules(self.rollout_rs, self.rollout_rs_threshold))
        if self.geo_mask is not None:
            geo_lower, geo_upper = _parse_bounds("geo_mask", self.geo_mask)
            if geo_lower is None:
                raise ValueError(f"geo_mask must be 'lower_upper' ratio bounds, got {shown(self.geo_mask)}")
            object.__setattr__(self, "geo_bounds", (geo_lower, geo_upper))

    @property
    def reads_policy_logp(self) -> bool:
        """Whether the correction reads the policy's own log-probs (bypass, IPO, the squared-log term): then it is
        formed after the vocabulary pass, on the whole `[B, T]`."""
        return self.bypass_mode or self.ipo_threshold is not None or self.log_ratio_penalty != 0.0

    @property
    def loss_reads_policy_logp(self) -> bool:
        """Whether the loss itself (not only the metrics) depends on the correction formed from the policy's
        log-probs: then no token-level fused epilogue can form it."""
        weighs = self.rollout_is is not None or bool(self.rules) or self.geo_bounds is not None
        return self.ipo_threshold is not None or self.log_ratio_penalty != 0.0 or (self.bypass_mode and weighs)

    @classmethod
    def from_trl(cls, mode: str, clip_min: float | None = None, clip_max: float | None = 3.0) -> RolloutCorrection:
        """TRL's `vllm_importance_sampling_mode` (token/sequence × truncate/mask) with its clip bounds: the same
        weights as TRL's (the ratio unclamped, bounds None = none)."""
        _check_choice("vllm_importance_sampling_mode", mode, TRL_MODES)
        level, bounds = mode.split("_")
        return cls(
            rollout_is=level,
            rollout_is_threshold=clip_max,
            rollout_is_threshold_lower=clip_min,
            rollout_is_bounds="mask" if bounds == "mask" else "truncate",
            log_ratio_bound=None,
        )

    @classmethod
    def from_verl(cls, config) -> RolloutCorrection:
        """verl's `RolloutCorrectionConfig` (or a mapping of its fields). Under bypass with verl's `ppo_clip` the IS
        weights are not applied (the clip's ratio is the correction), so `rollout_is` is dropped there; the policy
        loss itself (verl's `loss_type`) is the caller's `loss_type` (`VERL_BYPASS_LOSS`)."""
        get = config.get if hasattr(config, "get") else lambda name, default=None: getattr(config, name, default)
        bypass = bool(get("bypass_mode", False))
        level = get("rollout_is", None)
        threshold = get("rollout_is_threshold", 2.0)
        if bypass and get("loss_type", "ppo_clip") == "ppo_clip" or threshold is None:
            level = None  # verl computes no weights without a threshold, and ppo_clip never applies them
        return cls(
            rollout_is=level,
            rollout_is_threshold=threshold if level is not None else 2.0,
            rollout_is_batch_normalize=bool(get("rollout_is_batch_normalize", False)) and level is not None,
            rollout_rs=get("rollout_rs", None),
            rollout_rs_threshold=get("rollout_rs_threshold", None),
            bypass_mode=bypass,
        )


VERL_BYPASS_LOSS = {"ppo_clip": None, "reinforce": "gpg"}  # verl's bypass loss_type -> this project's loss_type
# verl 0.9.1's RolloutCorrectionConfig presets (their default arguments): name -> (fields, verl's bypass loss_type)
VERL_PRESETS: dict[str, tuple[dict, str | None]] = {
    "decoupled_token_is": (dict(rollout_is="token", rollout_is_threshold=2.0), None),
    "decoupled_seq_is": (dict(rollout_is="sequence", rollout_is_threshold=2.0), None),
    "decoupled_token_icepop": (dict(rollout_is="token", rollout_is_threshold="0.5_5.0"), None),
    "decoupled_seq_is_rs": (
        dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
        None,
    ),
    "decoupled_geo_rs": (dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"), None),
    "decoupled_geo_rs_seq_tis": (
        dict(
            rollout_is="sequence",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
        ),
        None,
    ),
    "decoupled_geo_rs_token_tis": (
        dict(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"
        ),
        None,
    ),
    "decoupled_k3_rs": (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01), None),
    "decoupled_k3_rs_seq_tis": (
        dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
        None,
    ),
    "decoupled_k3_rs_token_tis": (
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
        None,
    ),
    "bypass_ppo_clip": (dict(bypass_mode=True), "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (
        dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True),
        "ppo_clip",
    ),
    "bypass_ppo_clip_k3_rs": (
        dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, bypass_mode=True),
        "ppo_clip",
    ),
    "bypass_pg_is": (dict(rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True), "reinforce"),
    "bypass_pg_token_icepop": (dict(rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True), "reinforce"),
    "bypass_pg_geo_rs": (
        dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True),
        "reinforce",
    ),
    "bypass_pg_geo_rs_seq_tis": (
        dict(
            rollout_is="sequence",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
            bypass_mode=True,
        ),
        "reinforce",
    ),
    "bypass_pg_geo_rs_token_tis": (
        dict(
            rollout_is="token",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
            bypass_mode=True,
        ),
        "reinforce",
    ),
}


CORRECTION_FIELDS = frozenset(f.name for f in dataclasses.fields(RolloutCorrection) if f.init)


def preset(name: str) -> tuple[RolloutCorrection, str | None]:
    """verl's preset `name` as (the record, the loss_type it needs: "gpg" for verl's REINFORCE, else None)."""
    _check_choice("rollout_correction preset", name, tuple(VERL_PRESETS))
    fields, verl_loss = VERL_PRESETS[name]
    return RolloutCorrection(**fields), VERL_BYPASS_LOSS.get(verl_loss)


def as_rollout_correction(value) -> tuple[RolloutCorrection | None, str | None]:
    """`LossOptions.rollout_correction` as given (a record, a mapping of its fields, a verl preset name, or None)
    as (the record or None, the loss_type a preset needs or None); anything else is a TypeError naming the option."""
    if value is None or isinstance(value, RolloutCorrection):
        return value, None
    if isinstance(value, str):
        return preset(value)
    if isinstance(value, Mapping):
        unknown = sorted(map(str, set(value) - CORRECTION_FIELDS))
        if unknown:
            raise TypeError(
                f"rollout_correction: unknown field(s) {unknown}; valid fields are {sorted(CORRECTION_FIELDS)}"
            )
        return RolloutCorrection(**value), None
    raise TypeError(
        f"rollout_correction must be a RolloutCorrection, a mapping of its fields or a preset name, got {shown(value)}"
    )


def correction_fields(correction: RolloutCorrection) -> dict:
    """The record's fields as given to its constructor (a config file's mapping)."""
    return {name: getattr(correction, name) for name in sorted(CORRECTION_FIELDS)}


def _parse_bounds(name: str, spec: str | float) -> tuple[float | None, float]:
    """verl's threshold spec: "upper" or "lower_upper" -> (lower or None, upper), each a finite float > 0."""
    parts = str(spec).strip().split("_", 1)
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"{name} must be a number or 'lower_upper', got {shown(spec)}") from None
    for value in values:
        if not 0.0 < value < math.inf:
            raise ValueError(f"{name} bounds must be finite and > 0, got {shown(spec)}")
    if len(values) == 2 and not values[0] <= values[1]:
        raise ValueError(f"{name} must have lower <= upper, got {shown(spec)}")
    return (values[0], values[1]) if len(values) == 2 else (None, values[0])


def _parse_rules(statistics: str | None, thresholds: float | str | None) -> tuple[RejectionRule, ...]:
    """verl's `rollout_rs` / `rollout_rs_threshold` pair as rules (duplicates dropped, in order): one threshold is
    shared by every statistic; a k1 statistic given only an upper ratio bound gets its reciprocal as the lower."""
    if statistics is None:
        if thresholds is not None:
            raise ValueError(
                f"rollout_rs_threshold needs rollout_rs, got threshold {shown(thresholds)} and no rollout_rs"
            )
        return ()
    if not isinstance(statistics, str):
        raise TypeError(f"rollout_rs must be a comma-separated str, got {shown(statistics)}")
    names = list(dict.fromkeys(part.strip() for part in statistics.split(",") if part.strip()))
    if not names:
        raise ValueError(f"rollout_rs must name at least one of {RS_STATISTICS}, got {shown(statistics)}")
    for name in names:
        _check_choice("rollout_rs", name, RS_STATISTICS)
    if thresholds is None or isinstance(thresholds, bool):
        raise ValueError(f"rollout_rs_threshold is required with rollout_rs={shown(statistics)}")
    specs = [thresholds] if not isinstance(thresholds, str) else [s.strip() for s in thresholds.split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold must give one threshold or one per statistic ({len(names)}), got {shown(thresholds)}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    rules = []
    for name, spec in zip(names, specs, strict=True):
        lower, upper = _parse_bounds(f"rollout_rs_threshold of {name}", spec)
        if name.endswith("k1"):
            lower = 1.0 / upper if lower is None else lower
        elif lower is not None:
            raise ValueError(f"rollout_rs_threshold of {name} is an upper bound (no '_'), got {shown(spec)}")
        rules.append(RejectionRule(name, lower, upper))
    return tuple(rules)


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {shown(value)}")


def _check_positive_or_none(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {shown(value)}")
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be finite and > 0 (or None), got {value}")

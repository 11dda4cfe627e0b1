"""verl (0.9.1): this project's policy losses in verl's policy-loss registry, and a drop-in for verl's fused
log-prob + entropy entry point.

    from grpo_kernels.integrations import verl as gk_verl

    gk_verl.register()             # then actor_rollout_ref.actor.policy_loss.loss_mode=gk_dapo (gk_<loss_type>)
    gk_verl.patch_fused_kernels()  # with actor_rollout_ref.model.use_fused_kernels=True, fused_kernels_backend=triton
    gk_verl.patch_fused_kernels(rollout=config.actor_rollout_ref.rollout)  # the same, replaying its top_k / top_p

Both act in the process that calls them, and verl computes its losses in its Ray workers: call them there too, e.g.
from a module named in `VERL_USE_EXTERNAL_MODULES` (verl imports those in every process that imports verl).
verl is imported lazily; without it these functions raise an ImportError naming `pip install "grpo-kernels[verl]"`.

verl hands a policy loss log-probs, not logits, so a registered loss is the loss algebra alone on `[B, T]`
(`build_terms` + `compute_loss`): no vocabulary pass. How verl's call maps onto `LossOptions`:
- `config.clip_ratio_low` / `clip_ratio_high` (each `clip_ratio` when None) -> `epsilon` / `epsilon_high`;
  `config.clip_ratio_c` -> `clip_ratio_c` (dual clip) for the clipped surrogates that verl's `vanilla` dual-clips,
  i.e. all of `CLIPPED_SURROGATE_TYPES` but `gspo_token` (verl's `gspo` has none); `tau_pos` / `tau_neg` -> sapo's
  temperatures; `policy_loss.clip_cov_*`, `kl_cov_ratio`, `ppo_kl_coef` -> the same names (None: verl's fallbacks).
- dppo_tv / dppo_kl: the same `clip_ratio_low` / `clip_ratio_high` are DPPO's divergence thresholds (`epsilon` /
  `epsilon_high`), `config.clip_ratio_c` its truncation cap of the IS weight (`clip_ratio_c`; 20 where the config
  lacks the field, verl's fallback). dro: `policy_loss.dro_beta` -> `dro_beta` (required, > 0, as in verl).
- `loss_agg_mode` and `config.global_batch_info` (`dp_size`, `batch_num_tokens`, `global_batch_size`,
  `loss_scale_factor`) -> `loss_agg_mode`, `num_items_in_batch`, `num_sequences_in_batch`, `loss_scale_factor`, and
  the loss times `dp_size` (verl's agg_loss: DDP averages the ranks' gradients). verl 0.9.1's
  `seq-mean-token-sum-norm` also divides by the sequence count, which `LossOptions.loss_scale_factor` takes here.
- `rollout_is_weights` -> `is_ratio`. `cispo` is verl's two-sided form (`cispo_two_sided=True`).
- Where verl's function of the same loss fixes the aggregation, so does ours: `sapo` always `seq-mean-token-mean`,
  `gmpo` (verl `geo_mean`) the mean over the micro-batch's sequences whatever `loss_agg_mode`, without dp_size.
Loss types that differ only in their normaliser (grpo, bnpo, dr_grpo, dapo, luspo) are therefore one loss here.
verl's KL loss (`use_kl_loss`) and entropy bonus (`entropy_coeff`) stay verl's: they are not in this call.
Differences from verl's functions, at numerical extremes only: log-ratios are clamped to ±20 everywhere (verl:
vanilla, sapo, cispo the same; gspo at +10; clip_cov, kl_cov, geo_mean not at all), and means over no tokens are 0.
`tests/test_verl.py` holds each registered loss to verl's own function of the same kind, and
`tests/test_verl_engine.py` runs them in verl's engine-side `ppo_loss` (the call verl's workers make).
verl's `bypass_mode` is the trainer's choice of old log-probs (the rollout's): see docs/verl.md. A registered loss
whose `policy_loss.rollout_correction` has `bypass_mode=True` forms that correction itself, as verl's `bypass_mode`
loss does (`bypass_correction`: rejection, REINFORCE's IS weights, the `rollout_corr/` metrics); a decoupled one is
verl's trainer's, applied before the loss (docs/mismatch.md).
A registered loss refuses, in one line naming the argument, a config that is not a mapping (verl's ActorConfig or
a DictConfig), a non-numeric field it reads, and tensors whose shapes are not log_prob's `[B, T]` (advantages and
rollout_is_weights also `[B]`).
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from grpo_kernels.api import fused_linear_token_logprobs
from grpo_kernels.kernels import parallel
from grpo_kernels.losses.loss import compute_loss
from grpo_kernels.losses.mismatch import rollout_correction
from grpo_kernels.losses.terms import build_terms
from grpo_kernels.option_checks import check_option
from grpo_kernels.options import CLIPPED_SURROGATE_TYPES, DPPO_TYPES, LOSS_TYPES, LossOptions
from grpo_kernels.rollout_correction import RolloutCorrection

INSTALL = 'pip install "grpo-kernels[verl]"'
PREFIX = "gk_"
_PREFIX_CHARS = re.compile(r"[A-Za-z0-9_.-]*")  # what a Hydra override `policy_loss.loss_mode=<name>` can carry
# LossOptions a registered loss may fix (`register(**loss_options)`): everything else comes from verl's call, or
# needs what that call does not carry (logits, entropies, ref log-probs: beta, entropy_coef, top_entropy_quantile).
EXTRA_OPTIONS = (
    "delta",
    "importance_sampling_level",
    "off_policy_mask_threshold",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)
_VERL_POLICY_DEFAULTS = {  # verl's fallbacks when config.policy_loss holds None (compute_policy_loss_clip_cov/kl_cov)
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 1.0,
}
_BATCH_INFO = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")  # config.global_batch_info
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Any]]]


def _verl(module: str) -> ModuleType:
    """Import a verl module; a missing verl is an ImportError naming the extra that installs it."""
    try:
        importlib.import_module("verl")
    except ModuleNotFoundError as error:
        if error.name != "verl":
            raise
        raise ImportError(f"grpo_kernels.integrations.verl needs verl (tested with 0.9.1): {INSTALL}") from error
    return importlib.import_module(module)


# ------------------------------------------------------------------------------------------------ policy losses


def policy_loss_fn(loss_type: str, **loss_options) -> PolicyLossFn:
    """`loss_type` as a verl policy loss: `fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights) -> (pg_loss, metrics)`, verl 0.9.1's `PolicyLossFn`.

    Tensors `[B, T]` (advantages `[B, T]` or `[B]`; rollout_is_weights `[B, T]` or `[B]`); `config` is verl's actor
    config (`ActorConfig`, or any mapping with its fields). `loss_options` fix the `EXTRA_OPTIONS` fields. Returns the
    0-dim loss (differentiable w.r.t. log_prob) and float metrics under verl's names: `actor/ppo_kl` (the masked mean
    of old − new log-prob; kl_cov: of |new − old|), `actor/pg_clipfrac` and `actor/pg_clipfrac_lower` with the meaning
    verl's loss of the same kind gives them.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    refused = sorted(set(loss_options) - set(EXTRA_OPTIONS))
    if refused:
        raise TypeError(
            f"{refused} cannot be fixed for a verl policy loss: verl's call sets them or lacks their inputs "
            f"(verl's own use_kl_loss / entropy_coeff add KL and entropy terms); allowed: {EXTRA_OPTIONS}"
        )
    LossOptions(**_placeholder(loss_type), **loss_options)  # invalid combinations fail here, not mid-training

    def fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        _check_call(fn.__name__, config, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        options, dp_size = options_from_config(loss_type, config, loss_agg_mode, response_mask, loss_options)
        mask, corrected = response_mask, bypass_correction(config, loss_type, log_prob, old_log_prob, response_mask)
        if corrected is not None:  # verl's bypass: π_old is the rollout's, the correction reads the policy's logp
            rollout_is_weights = corrected.weights
            mask = mask if corrected.keep is None else (mask.bool() & corrected.keep).to(mask.dtype)  # [B, T]
        terms = build_terms(
            log_prob,
            old_logp=old_log_prob,
            advantages=advantages,
            mask=mask,
            is_ratio=rollout_is_weights,
            options=options,
        )
        output, _ = compute_loss(terms, options)
        metrics = _verl_metrics(loss_type, output.metrics, terms)
        if corrected is not None:
            metrics.update({name: value.item() for name, value in corrected.metrics.items()})
        return output.loss * dp_size, metrics

    fn.__name__ = fn.__qualname__ = f"{PREFIX}{loss_type}"
    fn.__doc__ = f"grpo-kernels' {loss_type!r} loss with verl's policy-loss signature (policy_loss_fn)."
    fn.grpo_kernels_loss_type = loss_type
    return fn


def register(loss_types: tuple[str, ...] = LOSS_TYPES, prefix: str = PREFIX, **loss_options) -> tuple[str, ...]:
    """Add `prefix + loss_type` for each of `loss_types` to verl's policy-loss registry (`register_policy_loss`);
    returns the names. `loss_options` (`EXTRA_OPTIONS`) apply to all of them.

    All or nothing: the prefix (a str of letters, digits, `_`, `.`, `-`), every name and every loss are checked
    before the first one is added, so an error leaves verl's registry as it was. Registering again replaces this
    project's earlier entries (idempotent); a name verl or someone else already holds is a ValueError.
    """
    if not isinstance(prefix, str) or not _PREFIX_CHARS.fullmatch(prefix):
        shown = repr(prefix) if isinstance(prefix, str) else type(prefix).__name__
        raise TypeError(f"prefix must be a str of letters, digits, '_', '.' or '-', got {shown}")
    if isinstance(loss_types, str) or not all(isinstance(t, str) for t in loss_types):
        raise TypeError(f"loss_types must be a tuple of loss-type names, got {loss_types!r}")
    core_algos = _verl("verl.trainer.ppo.core_algos")
    names = [f"{prefix}{loss_type}" for loss_type in loss_types]
    held = {name: core_algos.POLICY_LOSS_REGISTRY.get(name) for name in names}
    taken = [f"{n!r} ({fn})" for n, fn in held.items() if fn is not None and not hasattr(fn, "grpo_kernels_loss_type")]
    if taken:
        raise ValueError(f"verl's policy-loss registry already holds {', '.join(taken)}: choose another prefix")
    losses = [policy_loss_fn(loss_type, **loss_options) for loss_type in loss_types]  # each checks its options
    for name, fn in zip(names, losses, strict=True):
        core_algos.register_policy_loss(name)(fn)
    return tuple(names)


def _check_call(
    name: str,
    config: Any,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    rollout_is_weights: Tensor | None,
) -> None:
    """One line naming the argument for a config that is not verl's actor config, or a tensor of the wrong shape."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"{name}: config must be verl's actor config (an ActorConfig, a DictConfig or a mapping of its fields), "
            f"got {type(config).__name__}"
        )
    for field in ("policy_loss", "global_batch_info"):
        if _get(config, field) is not None and not isinstance(config[field], Mapping):
            raise TypeError(f"{name}: config.{field} must be a mapping, got {type(config[field]).__name__}")
    tensors = dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if rollout_is_weights is not None:
        tensors["rollout_is_weights"] = rollout_is_weights
    for arg, x in tensors.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}")
    if log_prob.dim() != 2:
        raise ValueError(f"{name}: log_prob must be [B, T], got {list(log_prob.shape)}")
    B, T = log_prob.shape
    for arg, x in tensors.items():
        per_sequence = arg in ("advantages", "rollout_is_weights") and list(x.shape) in ([B], [B, 1])
        if list(x.shape) != [B, T] and not per_sequence:
            allowed = f"[B, T] = {[B, T]} or [B] = {[B]}" if arg in ("advantages", "rollout_is_weights") else [B, T]
            raise ValueError(f"{name}: {arg} must be {allowed} (log_prob's), got {list(x.shape)}")


def _get(config: Any, name: str, default: Any = None) -> Any:
    """config.name (a verl BaseConfig, an omegaconf DictConfig or a dict), `default` when absent or None."""
    value = config.get(name, None) if hasattr(config, "get") else getattr(config, name, None)
    return default if value is None else value


def _number(config: Any, name: str, default: Any = None, where: str = "config") -> Any:
    """`_get`, refused in one line naming `where.name` unless a real number (or a 0-dim tensor) or None."""
    value = _get(config, name, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (value is None or number or (isinstance(value, Tensor) and value.dim() == 0)):
        raise TypeError(f"{where}.{name} must be a number, got {type(value).__name__} {str(value)[:60]!r}")
    return value


def _placeholder(loss_type: str) -> dict:
    """What LossOptions needs of a loss type that verl's call fills in (dr_grpo's length, dro's β; cispo is
    verl's two-sided form)."""
    needs = {"dr_grpo": {"max_completion_length": 1}, "dro": {"dro_beta": 1.0}, "cispo": {"cispo_two_sided": True}}
    return {"loss_type": loss_type, **needs.get(loss_type, {})}


def options_from_config(
    loss_type: str, config: Any, loss_agg_mode: str, response_mask: Tensor, loss_options: dict
) -> tuple[LossOptions, int]:
    """The LossOptions of one verl call, and the factor dp_size the loss is multiplied by (see the module doc)."""
    clip = _number(config, "clip_ratio", 0.2)
    fields = dict(
        loss_options,
        loss_type=loss_type,
        epsilon=_number(config, "clip_ratio_low", clip),
        epsilon_high=_number(config, "clip_ratio_high", clip),
    )
    if loss_type == "dr_grpo":  # its own normaliser is overridden by loss_agg_mode below; LossOptions needs a length
        fields["max_completion_length"] = response_mask.shape[-1]
    if loss_type in CLIPPED_SURROGATE_TYPES and loss_type != "gspo_token":
        fields["clip_ratio_c"] = _number(config, "clip_ratio_c", 3.0)
    if loss_type in DPPO_TYPES:  # the truncation cap of the IS weight; verl's fallback where the config lacks it
        fields["clip_ratio_c"] = _number(config, "clip_ratio_c", 20.0)
    if loss_type == "sapo":
        fields.update(
            sapo_temperature_pos=_number(config, "tau_pos", 1.0), sapo_temperature_neg=_number(config, "tau_neg", 1.05)
        )
    if loss_type == "cispo":
        fields["cispo_two_sided"] = True
    policy = _get(config, "policy_loss", {})
    if loss_type == "dro":
        beta = _number(policy, "dro_beta", where="config.policy_loss")
        if beta is None or not beta > 0:
            raise ValueError(f"loss_type 'dro' needs config.policy_loss.dro_beta > 0 (as verl's dro), got {beta}")
        fields["dro_beta"] = beta
    names = {"clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), "kl_cov": ("kl_cov_ratio", "ppo_kl_coef")}
    for name in names.get(loss_type, ()):
        fields[name] = _number(policy, name, _VERL_POLICY_DEFAULTS[name], where="config.policy_loss")
    if loss_type == "gmpo":  # verl geo_mean: torch.mean over the sequences, whatever the mode and the global batch
        return LossOptions(**fields), 1
    mode = "seq-mean-token-mean" if loss_type == "sapo" else loss_agg_mode
    info = _get(config, "global_batch_info", {})
    batch_info = {name: _number(info, name, where="config.global_batch_info") for name in _BATCH_INFO}
    dp_size = int(batch_info["dp_size"] or 1)
    tokens, sequences = batch_info["batch_num_tokens"], batch_info["global_batch_size"]
    if dp_size > 1 and mode == "token-mean" and tokens is None:
        raise ValueError("(global) batch_num_tokens is required in config.global_batch_info when dp_size > 1")
    if dp_size > 1 and mode.startswith("seq-mean") and sequences is None:
        raise ValueError("global_batch_size is required in config.global_batch_info when dp_size > 1")
    factor = batch_info["loss_scale_factor"]
    if mode == "seq-mean-token-sum-norm":  # verl 0.9.1: Σ_b Σ_t L / (S · factor); LossOptions: Σ L / factor
        count = int((response_mask.sum(-1) > 0).sum()) if sequences is None else sequences
        factor = (response_mask.shape[-1] if factor is None else factor) * max(count, 1)
    fields.update(loss_agg_mode=mode, num_items_in_batch=tokens, num_sequences_in_batch=sequences)
    return LossOptions(**fields, loss_scale_factor=factor), dp_size


def bypass_correction(config: Any, loss_type: str, log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor):
    """verl's `policy_loss.rollout_correction` under `bypass_mode` (old_log_prob is the rollout's): the correction of
    the policy's log-probs against it (`losses.mismatch.rollout_correction`), as verl's bypass loss forms it; None
    when the config holds no correction or a decoupled one (verl's trainer applies that before the loss). verl's
    `loss_type="reinforce"` is this project's gpg: another registered loss is refused in one line."""
    settings = _get(_get(config, "policy_loss", {}), "rollout_correction")
    if settings is None or not _get(settings, "bypass_mode", False):
        return None
    if _get(settings, "loss_type", "ppo_clip") == "reinforce" and loss_type != "gpg":
        raise ValueError(
            f"{PREFIX}{loss_type}: policy_loss.rollout_correction.loss_type='reinforce' is verl's REINFORCE: use gk_gpg"
        )
    correction = RolloutCorrection.from_verl(settings)
    return rollout_correction(log_prob.detach(), old_log_prob, response_mask.bool(), correction)


def _verl_metrics(loss_type: str, metrics: dict[str, Tensor], terms) -> dict[str, Any]:
    """Our metrics under verl's names, with the meaning verl's loss of the same kind gives each (floats, as verl)."""
    if loss_type == "kl_cov":
        return {"actor/ppo_kl": metrics["ppo_kl_abs"].item()}
    mask = terms.mask
    ppo_kl = (-terms.token_log_ratio.detach() * mask).sum() / mask.sum().clamp(min=1.0)
    out = {"actor/ppo_kl": ppo_kl.item()}
    if loss_type == "clip_cov":
        out["actor/pg_clipfrac"] = metrics["pg_clipfrac"].item()
    elif loss_type == "gmpo":  # geo_mean: log-space clip at A > 0, and at A < 0
        out["actor/pg_clipfrac"] = metrics["clip_ratio/high_mean"].item()
        out["actor/pg_clipfrac_lower"] = metrics["clip_ratio/low_mean"].item()
    elif loss_type == "sapo":  # a soft gate: verl reports 0 for both
        out["actor/pg_clipfrac"] = out["actor/pg_clipfrac_lower"] = 0.0
    elif loss_type == "vespo":
        out["actor/vespo/phi_seq_mean"] = metrics["vespo/phi_seq_mean"].item()
    elif loss_type in DPPO_TYPES:  # tokens outside the trust region; kept tokens whose IS weight was truncated
        out["actor/pg_clipfrac"] = metrics["clip_ratio/region_mean"].item()
        truncated = metrics.get("clip_ratio/truncated_mean")
        out["actor/pg_clipfrac_lower"] = 0.0 if truncated is None else truncated.item()
    elif loss_type not in ("gpg", "dro"):  # clipped surrogates and cispo: clipped tokens, and where the dual clip binds
        out["actor/pg_clipfrac"] = metrics["clip_ratio/region_mean"].item()
        dual = metrics.get("clip_ratio/dual_mean")
        out["actor/pg_clipfrac_lower"] = 0.0 if dual is None else dual.item()
    return out


# ------------------------------------------------------------------------------------- fused log-prob + entropy


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: Any = None,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Drop-in for verl's `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy` (its fused log-prob +
    entropy pass under `use_fused_kernels`), on `fused_linear_token_logprobs(..., with_entropy=True)`.

    hidden `[..., H]` (verl: `[B, T, H]` or `[N, H]`), weight `[V, H]`, labels `[...]` token ids in [0, V),
    softmax((hidden @ weight.T) / temperature). Returns float32 `(logprobs, entropy)` as verl's does: logprobs
    `[N]` (N = all leading dims, flattened) for reduction "none", their sum or mean (0-dim) for "sum" / "mean";
    entropy `[N]` always. Differentiable w.r.t. hidden and weight; the `[N, V]` logits are never stored.
    `dist_process_group` as verl means it (Megatron's tensor-parallel group): weight `[V_r, H]` is rank r's rows
    [r·V_r, (r + 1)·V_r) of the lm_head (equal shards), labels are whole-vocabulary ids, logprobs and entropy are the
    whole vocabulary's on every rank (`kernels.parallel`: O(N) statistics cross ranks), dW is the shard's, and dH is
    this rank's share, left for the caller to sum (Megatron's sequence-parallel gather does), as verl's kernel
    leaves it. A group of one rank holds the whole vocabulary. `top_k` / `top_p` (0 and 1.0: off) replay a truncated
    sampler: log-probs and entropy over the tokens it kept (docs/sampling_replay.md); `patch_fused_kernels(rollout=)`
    sets them from verl's rollout config.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    tp = {}
    if dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1:
        rank = torch.distributed.get_rank(dist_process_group)
        tp = dict(process_group=dist_process_group, vocab_start=rank * weight.shape[0])
    with parallel.partial_hidden_grad():
        logp, entropy = fused_linear_token_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            labels.reshape(-1),
            temperature=temperature,
            with_entropy=True,
            top_k=top_k,
            top_p=top_p,
            **tp,
        )  # [N], [N]
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, entropy


linear_cross_entropy.grpo_kernels_patch = True  # how a patch tells ours, from any load of this module, from verl's
_HOME = "verl.utils.kernel.linear_cross_entropy"
_ORIGINAL = "_grpo_kernels_original"  # verl's function, kept on verl's module while patched (outlives our reload)


def _is_ours(fn: Any) -> bool:
    return getattr(fn, "grpo_kernels_patch", False) is True


def patch_fused_kernels(rollout: Any = None) -> None:
    """Swap verl's `linear_cross_entropy` for this module's everywhere verl holds it: its home module (verl's HF
    model forwards import it from there at each call) and every loaded `verl.*` module that imported it (Megatron's
    fused forwards); modules imported later pick up ours from the home module. verl's
    `fused_kernels_backend="torch"` path (FusedLinearForPPO) does not use it.

    `rollout`: verl's rollout config (`actor_rollout_ref.rollout`: its dataclass, a DictConfig or a dict). Its
    `top_k` / `top_p` (verl's names and off values: -1 and 1.0) are then replayed on every log-prob pass through
    the patched function, so that the actor's old and current log-probs match the rollout's processed log-probs.
    verl calls the same function for a reference model that uses the fused kernels in the same process: its
    log-probs are replayed too there (docs/verl.md).

    Idempotent, and safe across reloads: verl's function is kept on verl's module (not here), ours is told by a
    marker (not by identity), so a patch after `importlib.reload` of this module or of verl's replaces the earlier
    load's function too, and `unpatch_fused_kernels` still restores verl's.
    """
    home = _verl(_HOME)
    ours = linear_cross_entropy
    rule = rollout_rule(rollout)
    if rule != {"top_k": 0, "top_p": 1.0}:
        ours = functools.partial(linear_cross_entropy, **rule)
        ours.grpo_kernels_patch = True
    if not _is_ours(home.linear_cross_entropy):  # verl's: first patch, or verl's module was reloaded since
        setattr(home, _ORIGINAL, home.linear_cross_entropy)
    original = getattr(home, _ORIGINAL, None)
    for module in _verl_modules():
        held = getattr(module, "linear_cross_entropy", None)
        if held is not None and (held is original or _is_ours(held)):
            module.linear_cross_entropy = ours


def rollout_rule(rollout: Any) -> dict[str, int | float]:
    """{"top_k", "top_p"} of verl's rollout config in the project's off values (top_k 0, top_p 1.0); None: off.
    Refuses, naming the field, a top_k below -1 or a top_p outside (0, 1] (`option_checks`' messages)."""
    if rollout is None:
        return {"top_k": 0, "top_p": 1.0}
    top_k, top_p = _get(rollout, "top_k", -1), _get(rollout, "top_p", 1.0)
    top_k = 0 if top_k == -1 else top_k
    check_option("top_k", top_k, label="rollout.top_k")
    check_option("top_p", top_p, label="rollout.top_p")
    return {"top_k": top_k, "top_p": float(top_p)}


def unpatch_fused_kernels() -> None:
    """Put verl's `linear_cross_entropy` back wherever a patch (of any load of this module) or an import after it
    put ours; nothing to do when not patched."""
    home = sys.modules.get(_HOME)
    original = None if home is None else home.__dict__.pop(_ORIGINAL, None)
    if original is None:
        return
    for module in _verl_modules():
        if _is_ours(getattr(module, "linear_cross_entropy", None)):
            module.linear_cross_entropy = original


def _verl_modules() -> list[ModuleType]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("verl.") and isinstance(m, ModuleType)]

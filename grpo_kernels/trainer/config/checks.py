"""The value checks of a TrainConfig: each option in its range and among its choices, one error naming the option."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.integrations.attention import ATTN_IMPLEMENTATIONS
from grpo_kernels.option_checks import type_words
from grpo_kernels.options import IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_TYPES
from grpo_kernels.shown import shown
from grpo_kernels.trainer.config.record import DEMO_MAX_LENGTH, NOT_CLI, ROLLOUTS, TrainConfig
from grpo_kernels.trainer.logging import REPORT_TO
from grpo_kernels.trainer.old_logprobs import OLD_LOGPROBS
from grpo_kernels.trainer.parallel import PARALLEL_MODES
from grpo_kernels.trainer.precision import DTYPES
from grpo_kernels.trainer.sampler_correction import IS_MODES
from grpo_kernels.trainer.sampler_sync import SAMPLER_SYNC
from grpo_kernels.trainer.sampling_replay import truncates

_AT_LEAST = {  # field -> its smallest value (None, where the field allows it, is always accepted)
    "seed": 0,
    "steps": 1,
    "checkpoint_every": 0,
    "eval_every": 0,
    "torch_threads": 1,
    "hidden_size": 1,
    "num_layers": 1,
    "num_heads": 1,
    "lora_r": 1,
    "lora_alpha": 1,
    "max_sum": 0,
    "eval_size": 1,
    "prompts_per_step": 1,
    "num_generations": 2,
    "max_completion_length": 1,
    "vllm_importance_sampling_clip_min": 0.0,
    "num_iterations": 1,
    "max_num_gen_batches": 0,
    "gradient_accumulation_steps": 1,
    "max_tokens_per_microbatch": 1,
    "weight_decay": 0.0,
    "ref_model_sync_steps": 1,
    "ref_model_mixup_alpha": 0.0,
    "progress_every": 0,
    "progress_seconds": 0.0,
    "skip_nonfinite_steps": 0,
}
_POSITIVE = (
    "learning_rate",
    "max_grad_norm",
    "vllm_gpu_memory_utilization",
    "vllm_importance_sampling_clip_max",
    "sampler_sync_tolerance",
)
_AT_MOST = {"vllm_gpu_memory_utilization": 1.0, "ref_model_mixup_alpha": 1.0, "seed": 2**63 - 1}


def choices() -> dict[str, Sequence[str]]:
    """The valid values of the options that have a closed set of them."""
    return {
        "parallel": PARALLEL_MODES,
        "report_to": REPORT_TO,
        "rollout": ROLLOUTS,
        "advantage": ADVANTAGES.names(),
        "vllm_importance_sampling_mode": IS_MODES,
        "old_logprobs": OLD_LOGPROBS,
        "sampler_sync": SAMPLER_SYNC,
        "dtype": DTYPES,
        "ref_model_dtype": DTYPES,
        "vllm_dtype": DTYPES,
        "loss_type": LOSS_TYPES,
        "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
        "kl_estimator": KL_ESTIMATORS,
        "loss_agg_mode": LOSS_AGG_MODES,
        "attn_implementation": ATTN_IMPLEMENTATIONS,
    }


def check_config(config: TrainConfig) -> None:
    """A ValueError (TypeError for a wrong type) naming the first option whose value is out of range or not one of
    its choices. The loss options check themselves (`LossOptions`); the dataset, preset and device are checked where
    they are used (`build_task`, `presets.load`, `init_parallel`)."""
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name in NOT_CLI or (value is None and "None" in f.type):
            continue
        expected = f.type.split("|")[0].strip().split("[")[0]
        types = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,)}[expected]
        if not isinstance(value, types) or (expected in ("int", "float") and isinstance(value, bool)):
            raise TypeError(f"{f.name} must be {type_words(expected, 'None' in f.type)}, got {shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be finite, got {value}")
        if f.name in _AT_LEAST and value < _AT_LEAST[f.name]:
            raise ValueError(f"{f.name} must be >= {_AT_LEAST[f.name]}, got {shown(value)}")
        if f.name in _POSITIVE and not value > 0:
            raise ValueError(f"{f.name} must be > 0, got {shown(value)}")
        if f.name in _AT_MOST and value > _AT_MOST[f.name]:
            raise ValueError(f"{f.name} must be <= {_AT_MOST[f.name]}, got {shown(value)}")
    for name, valid in choices().items():
        value = getattr(config, name) if hasattr(config, name) else getattr(config.loss, name)
        if value is not None and value not in valid:
            raise ValueError(f"{name} must be one of {list(valid)}, got {shown(value)}")
    budget = config.max_completion_length
    if config.model == "tiny" and budget is not None and budget > DEMO_MAX_LENGTH:
        raise ValueError(f"max_completion_length must be <= {DEMO_MAX_LENGTH} for the tiny demo model, got {budget}")
    if config.model == "tiny" and config.hidden_size % config.num_heads:
        raise ValueError(f"num_heads ({config.num_heads}) must divide hidden_size ({config.hidden_size})")
    if config.replay_reference and not truncates(config.loss):
        raise ValueError("replay_reference replays the sampler's truncation, but top_k, top_p and min_p are all off")
    if config.resume and config.overwrite:
        raise ValueError("resume and overwrite contradict each other: --resume continues the run in output_dir")
    if (config.teacher is None) != (config.loss.teacher_kl_coef == 0.0):
        raise ValueError("teacher and teacher_kl_coef go together: --teacher names the model whose divergence "
                         f"--teacher-kl-coef > 0 weighs, got teacher={shown(config.teacher)}, "
                         f"teacher_kl_coef={config.loss.teacher_kl_coef}")  # fmt: skip

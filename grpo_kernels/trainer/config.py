"""TrainConfig: every trainer option once, with its default; the defaults run the CPU demo.

The command line is generated from the fields: `--output-dir runs/x` (or `--output_dir`), `--steps 100`,
`--resume` / `--no-resume`; the loss options are `LossOptions`' own fields, flat (`--loss-type dapo`, `--beta 0.04`,
`--epsilon-high 0.28`). `None` is written `none`. Each option's help is the comment next to its field (here, and in
`grpo_kernels/options.py` for the loss options), with its choices. Precedence, lowest first: the defaults (with
`--resume`: the run's own `config.yaml`), a paper preset (`--preset dapo`: its loss options, advantage estimator and
training settings here; its rewards, with `math_answer` standing for the task's reward, its sampler and its
regularizers are built by the trainer, `components.py`), a YAML file (`--config file.yaml`: TrainConfig fields as
keys, loss options under `loss:`), then the flags. `check_config` refuses values out of range, naming the option.
The paper's training settings (`TRAINING_SETTINGS`: G, lr, temperature, μ, generation budget) and where each
effective value came from (flag, config file, preset, default, task) are in `TrainConfig.sources`, which the trainer
completes (`settings.resolve_settings`) and `config.yaml` records. The generation budget is the paper's capped at the
task's (a paper's 20,480 tokens on a task whose answers take 3 would be all padding); a flag sets it outright.
The default preset is `grpo` (DeepSeekMath: ε = 0.2, β = 0.04 with the k3 estimator against a frozen reference,
group z-score advantages), so the demo shows a KL; `--preset none` starts from `LossOptions()` (TRL's defaults).
`TrainConfig.max_completion_length` is the generation budget and, unless `loss.max_completion_length` is set, also
Dr.GRPO's normaliser (as in TRL).
Nothing here imports transformers or the trainer, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import math
import textwrap
import tokenize
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_kernels import presets
from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.integrations.attention import ATTN_IMPLEMENTATIONS
from grpo_kernels.options import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LOSS_TYPES,
    LossOptions,
    check_epsilon_names,
    some_names,
)
from grpo_kernels.shown import shown
from grpo_kernels.trainer import run_names
from grpo_kernels.trainer.cli import Parser
from grpo_kernels.trainer.logging import REPORT_TO
from grpo_kernels.trainer.parallel import PARALLEL_MODES
from grpo_kernels.trainer.precision import DTYPES
from grpo_kernels.trainer.sampling_replay import truncates
from grpo_kernels.trainer.update import IS_MODES
from grpo_kernels.yaml_files import load_yaml, read_yaml

PER_STEP_LOSS_OPTIONS = ("num_items_in_batch", "num_sequences_in_batch")  # set by the trainer at each step
TRAINING_SETTINGS = tuple(presets.TRAINING_KEYS)  # a preset's training settings; `temperature` is the loss option
NOT_CLI = ("loss", "sources")  # TrainConfig fields without a flag of their own
DEFAULT_PRESET = "grpo"
DEMO_MAX_LENGTH = 65_536  # the tiny demo model's largest prompt and generation budget, in tokens (its context is
# sized from them, so no other limit would stop a typo of 10**12 tokens before it allocates)
ROLLOUTS = ("hf", "vllm")


@dataclass
class TrainConfig:
    """Options of `grpo_kernels.trainer.train`; the defaults train the tiny demo policy on CPU in a few minutes."""

    # ---- run
    output_dir: str | None = None  # the run's directory: config.yaml, metrics.jsonl, metrics.png, checkpoints/;
    # none: a new runs/<preset or demo>-<timestamp>
    overwrite: bool = False  # a new run into a non-empty output_dir clears it first (without it: an error)
    seed: int = 0  # seed of the weights, the prompts and the sampling
    steps: int = 600  # optimizer steps of the outer loop (each: one rollout batch, num_iterations updates)
    resume: bool = False  # continue the run in output_dir from its latest complete checkpoint, with its config.yaml
    # (only the options in run_dir.RESUMABLE, such as steps, may differ from it)
    start_if_no_checkpoint: bool = False  # with resume: start the run afresh when output_dir has no checkpoint yet
    # (without it: an error)
    checkpoint_every: int = 200  # steps between checkpoints (step 0, the initial policy, too); 0 = only the last
    final_checkpoint: bool = True  # a checkpoint of the last step, however the run ends (a skipped step, a signal)
    eval_every: int = 25  # steps between greedy evaluations on every prompt of the task; the last step always
    device: str = "auto"  # auto (cuda when available; under torchrun cuda:LOCAL_RANK), cpu, cuda or cuda:N
    parallel: str = "auto"  # under torchrun: ddp (what auto picks) or fsdp (FSDP2); none for one process
    report_to: str = "none"  # an experiment tracker besides metrics.jsonl (needs its package)
    torch_threads: int | None = 1  # CPU threads of torch ops (none: torch's default); 1 is fastest for tiny models
    # ---- policy
    model: str = "tiny"  # "tiny": a Llama built from the three sizes below; else a Hugging Face name or local path
    dtype: str = "auto"  # the policy's parameter dtype; auto: bfloat16 on a GPU, float32 on the CPU
    ref_model_dtype: str = "auto"  # the reference model's parameter dtype; auto: the policy's
    hidden_size: int = 64  # the tiny Llama's hidden size
    num_layers: int = 2  # the tiny Llama's decoder layers
    num_heads: int = 4  # the tiny Llama's attention heads (they divide hidden_size)
    lora: bool = False  # train LoRA adapters (peft) instead of every weight
    lora_r: int = 16  # the LoRA adapters' rank (their inner dimension)
    lora_alpha: int = 32  # LoRA scaling numerator (peft's lora_alpha)
    lora_target_modules: str = "all-linear"  # peft's target_modules: a comma-separated list or "all-linear"
    padding_free: bool = True  # pack each pass's sequences without padding (where the model supports it; else
    # padded, with a line saying why)
    attn_implementation: str = "auto"  # auto: flash_attention_2 when flash-attn is installed on CUDA, else sdpa
    # ---- data
    dataset: str = "addition"  # addition (generated, the demo), countdown (generated), gsm8k (Hugging Face hub),
    # or a path to a .jsonl file of {"prompt", "answer"[, "split"]} lines
    max_sum: int = 9  # addition: prompts a+b= with single digits and a + b <= max_sum (9: one-digit answers)
    eval_size: int = 256  # at most this many held-out prompts per evaluation
    # ---- rollout
    rollout: str = "hf"  # the generation engine: hf (transformers generate) or vllm (colocated vLLM; CUDA)
    prompts_per_step: int = 16  # prompts per optimizer step, over all ranks
    num_generations: int = 16  # G completions per prompt (TRL's name); group statistics need at least 2
    max_completion_length: int | None = None  # generation budget in tokens (TRL's name); none: the dataset's
    # (addition 3, countdown 16, gsm8k 256, jsonl 64)
    vllm_gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU memory, in (0, 1]
    vllm_enable_sleep_mode: bool = True  # vLLM frees its memory between rollouts
    vllm_dtype: str = "auto"  # the vLLM sampler's dtype; auto: the policy's (the importance ratio stays 1 by numerics)
    vllm_importance_sampling_correction: bool = True  # reweigh by π_old / π_vllm (TRL's names and defaults on)
    vllm_importance_sampling_mode: str = "sequence_mask"  # how the correction's ratio is truncated or masked
    vllm_importance_sampling_clip_max: float | None = 3.0  # the correction's upper cap (none: no cap)
    vllm_importance_sampling_clip_min: float | None = None  # the correction's lower cap (none: no cap)
    # ---- algorithm
    paper_settings: bool = False  # with --preset: the paper's G, lr, temperature, μ and generation budget (capped
    # at the task's); without it the preset's algorithm runs with the trainer's settings, tuned for the demo task
    preset: str | None = DEFAULT_PRESET  # paper preset (configs/papers/<name>.yaml) or preset YAML: the trainer
    # builds its rewards, sampler and regularizers; its loss options, advantage and training settings (G, lr,
    # temperature, μ; flags win) come in through `apply_preset` (the command line's `--preset` calls it; setting this
    # field alone changes none of them), its generation budget caps the task's
    advantage: str = "grpo"  # the advantage estimator (an ADVANTAGES name)
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)  # its hyperparameters, as a YAML mapping
    num_iterations: int = 1  # μ: optimizer updates per rollout batch (TRL's name)
    max_num_gen_batches: int | None = None  # DAPO / GPG samplers: generation rounds before giving up on filling a
    # batch (none: DAPO 30, GPG 20; 0: no limit)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer update on each rank (TRL's name)
    max_tokens_per_microbatch: int | None = None  # fill micro-batches up to this many tokens of the forward
    # (real tokens when padding-free), at least gradient_accumulation_steps of them; none: split by rows
    learning_rate: float = 1.0e-3  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm
    skip_nonfinite_steps: int = 0  # steps whose grad_norm is not finite (NaN, inf) that may skip their optimizer
    # step, each logged; past that many (0: at the first) the run stops there, its last good checkpoint kept
    sync_ref_model: bool = False  # refresh the reference model from the policy (TR-DPO mixing, TRL's names)
    ref_model_sync_steps: int = 512  # steps between refreshes of the reference model
    ref_model_mixup_alpha: float = 0.6  # π_ref ← α·π_θ + (1 − α)·π_ref at each refresh, α in [0, 1]
    replay_reference: bool = False  # with truncated sampling (top_k, top_p, min_p): the reference's log-probs over
    # the sampler's support too (default: the whole vocabulary, as NeMo RL; the policy's are always replayed)
    loss: LossOptions = field(default_factory=lambda: presets.load(DEFAULT_PRESET).loss)  # the preset's
    sources: dict[str, str] = field(default_factory=dict)  # where each of TRAINING_SETTINGS came from (flag,
    # config file, preset, default, task); `parse_args` records flags, the trainer derives the rest (settings.py)
    # ---- logging
    progress: bool = True  # progress: a live bar in a terminal, else a line every progress_every steps / seconds
    progress_every: int = 50  # without a terminal: a progress line every this many steps (0: never) ...
    progress_seconds: float = 60.0  # ... or this many seconds, whichever comes first (0: never)
    plot: bool = True  # metrics.png at the end (needs matplotlib)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML-able); `from_dict` gives the config back."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NOT_CLI}
        data["loss"] = {f.name: getattr(self.loss, f.name) for f in dataclasses.fields(LossOptions)}
        for name in PER_STEP_LOSS_OPTIONS:
            data["loss"].pop(name)
        data["sources"] = dict(self.sources)
        return data


def loss_options(config: TrainConfig) -> LossOptions:
    """The loss options the trainer uses: `config.loss`, with Dr.GRPO's constant the run's generation budget when it
    is unset or is the preset paper's own budget (the recipe's constant is its generation budget: 3,000 tokens of a
    recipe are 3 on a 3-token task, as DAPO's L_max scales in `presets.rewards_for_budget`)."""
    constant = config.loss.max_completion_length
    paper = presets.load(config.preset).training.max_completion_length if config.preset is not None else None
    if constant is not None and constant != paper:
        return config.loss
    return dataclasses.replace(config.loss, max_completion_length=config.max_completion_length)


def advantage_function(config: TrainConfig) -> Callable[..., Any]:
    """The ADVANTAGES estimator `config.advantage`, called as fn(rewards, group_ids, **inputs, **advantage_kwargs).

    The trainer passes the per-step inputs the estimator names (`components.ADVANTAGE_INPUTS`: correctness, lengths,
    mean_logp, entropy, mask; GDPO's reward matrix; PVPO's `reference_value` from its pre-rollouts). One that needs
    another (Stratified-GRPO's `strata`) and does not get it from `advantage_kwargs` is a ValueError here, before any
    work.
    """
    from grpo_kernels.trainer.components import ADVANTAGE_INPUTS, missing_advantage_inputs

    fn = ADVANTAGES.get(config.advantage)
    missing = missing_advantage_inputs(fn, config.advantage_kwargs)
    if missing:
        preset = f" (preset {shown(config.preset)})" if config.preset is not None else ""
        raise ValueError(
            f"advantage {shown(config.advantage)}{preset} needs per-step inputs {missing} that the trainer cannot "
            f"produce (it supplies rewards, group_ids and {list(ADVANTAGE_INPUTS)})"
        )
    return fn


def from_dict(data: Mapping[str, Any], base: TrainConfig | None = None, where: str = "config") -> TrainConfig:
    """`base` (default: the defaults) with the given fields replaced; `loss` is a mapping of loss options."""
    config = base or TrainConfig()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(map(str, set(data) - fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {some_names(unknown)}; valid keys are {sorted(fields)}")
    values = {k: v for k, v in data.items() if k != "loss"}
    if "sources" in values and not isinstance(values["sources"], Mapping):
        raise TypeError(f"{where}: sources must be a mapping of training settings, got {shown(values['sources'])}")
    loss = config.loss
    if data.get("loss") is not None:
        if not isinstance(data["loss"], Mapping):
            raise TypeError(f"{where}: loss must be a mapping of loss options, got {shown(data['loss'])}")
        given = dict(data["loss"])
        check_epsilon_names(given)
        loss_fields = {f.name: getattr(loss, f.name) for f in dataclasses.fields(LossOptions)}
        if given.get("epsilon_low") is not None and "epsilon" not in given:  # the alias given replaces epsilon
            loss_fields.pop("epsilon")
        try:
            loss = LossOptions.from_kwargs(**{**loss_fields, **given})
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}: loss: {error}") from None
    return dataclasses.replace(config, **values, loss=loss)


def apply_preset(config: TrainConfig, name: str | None, paper_settings: bool = True) -> TrainConfig:
    """The config with a paper preset's loss options, advantage estimator and training settings (G, lr, temperature,
    μ; TrainConfig's defaults where the paper gives none), and `preset` naming it: the trainer builds the preset's
    rewards, sampler and regularizers from that name (`components.PresetComponents`) and caps the generation budget
    at the paper's (`settings.resolve_settings`); `paper_settings=False` (the command line without
    `--paper-settings`) keeps `config`'s settings and budget. `None`: LossOptions' defaults, the `grpo` advantage
    with its defaults, TrainConfig's default settings and the task's reward alone."""
    defaults = TrainConfig()
    if name is None:
        settings = {n: getattr(defaults, n) for n in ("num_generations", "learning_rate", "num_iterations")}
        return dataclasses.replace(
            config, preset=None, loss=LossOptions(), advantage="grpo", advantage_kwargs={}, sources={}, **settings
        )
    preset = presets.load(name)
    training = preset.training
    settings = {
        n: getattr(defaults, n) if getattr(training, n) is None else getattr(training, n)
        for n in ("num_generations", "learning_rate", "num_iterations")
    }
    temperature = preset.loss.temperature if training.temperature is None else training.temperature
    if not paper_settings:
        settings = {n: getattr(config, n) for n in settings}
        temperature = config.loss.temperature
    return dataclasses.replace(
        config,
        preset=name,
        paper_settings=paper_settings,
        loss=dataclasses.replace(preset.loss, temperature=temperature),
        advantage=preset.advantage.name,
        advantage_kwargs=dict(preset.advantage.kwargs),
        sources={},
        **settings,
    )


# ------------------------------------------------------------------------------------------------ value checks
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
_POSITIVE = ("learning_rate", "max_grad_norm", "vllm_gpu_memory_utilization", "vllm_importance_sampling_clip_max")
_AT_MOST = {"vllm_gpu_memory_utilization": 1.0, "ref_model_mixup_alpha": 1.0, "seed": 2**63 - 1}


def choices() -> dict[str, Sequence[str]]:
    """The valid values of the options that have a closed set of them."""
    return {
        "parallel": PARALLEL_MODES,
        "report_to": REPORT_TO,
        "rollout": ROLLOUTS,
        "advantage": ADVANTAGES.names(),
        "vllm_importance_sampling_mode": IS_MODES,
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
            raise TypeError(f"{f.name} must be {f.type.replace('None', 'none')}, got {shown(value)}")
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


# --------------------------------------------------------------------------------------------------- command line
def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` -> the comment on its line and the comment lines right below it (its help);
    `# ---- ...` lines head sections and belong to no field."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {  # line -> (comment text, alone on its line)
        token.start[0]: (token.string.lstrip("#").strip(), not token.line[: token.start[1]].strip())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = node.end_lineno
            text, alone = comments.get(line, ("", False))
            parts = [] if alone else [text]
            while line + 1 in comments and comments[line + 1][1] and not comments[line + 1][0].startswith("----"):
                line += 1
                parts.append(comments[line][0])
            docs[node.target.id] = " ".join(p for p in parts if p)
    return docs


def _converter(annotation: str):
    """A string -> value function for a field's annotation (`int`, `float | None`, `dict[str, Any]`, ...)."""
    parts = [p.strip() for p in annotation.split("|")]
    nullable = "None" in parts
    base = next(p for p in parts if p != "None")
    parse = {"int": int, "float": float, "str": str}.get(base, lambda text: load_yaml(text, "a YAML value"))

    def convert(text: str):
        if nullable and text.lower() in ("none", "null"):
            return None
        return parse(text)

    convert.__name__ = base.split("[")[0]  # argparse names the type in its errors
    return convert


_METAVARS = {"int": "N", "float": "X", "str": "TEXT", "dict": "YAML"}


def _add_field(parser, name: str, annotation: str, default: Any, doc: str, valid: Sequence[str] | None) -> None:
    flag = f"--{name.replace('_', '-')}"
    shown = "none" if default is None else default
    extra = f"; one of: {', '.join(valid)}" if valid else ""
    help_text = f"{doc} (default: {shown}{extra})".replace("%", "%%")
    base = annotation.split("|")[0].strip().split("[")[0]
    kwargs: dict[str, Any] = dict(dest=name)
    if annotation == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=_converter(annotation), metavar=_METAVARS.get(base, "VALUE"))
    parser.add_argument(flag, help=help_text, **kwargs)
    if "_" in name:  # the field's own spelling (and --no-<field> for a bool) works too, unlisted
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS, **kwargs)


DESCRIPTION = """\
GRPO with the fused kernels. No arguments: the embedded CPU demo (a tiny Llama learns single-digit addition from
reward alone). A run lives in --output-dir: config.yaml, metrics.jsonl, metrics.png, checkpoints/. A new run needs
an empty or absent directory (--overwrite clears it); --resume continues the run there with its own config.yaml, of
which only where it stops and how it logs may change (--steps, --checkpoint-every, --eval-every, --progress-every,
...). Option values: none for None; the loss options are those of grpo_kernels.LossOptions. Errors are one line
(--debug shows the traceback)."""

EPILOG = """\
examples:
  python -m grpo_kernels.train --preset dapo --output-dir runs/dapo --steps 100
  python -m grpo_kernels.train --preset dapo --paper-settings --learning-rate 1e-3
  python -m grpo_kernels.train --output-dir runs/dapo --resume --steps 200
  python -m grpo_kernels.train --dataset countdown --config my_run.yaml"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m grpo_kernels.train",
        usage="%(prog)s [options]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only the flags given come back, so they override preset and YAML
    )
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="YAML",
        help="a YAML file of TrainConfig fields (loss options under loss:)",
    )
    valid = {
        **choices(),
        "preset": [*presets.available(), "none", "a preset YAML file"],
        "device": ["auto", "cpu", "cuda", "cuda:N"],
        "dataset": ["addition", "countdown", "gsm8k", "a .jsonl path"],
    }
    train_fields = parser.add_argument_group("trainer options (TrainConfig fields)")
    defaults, docs = TrainConfig(), field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in NOT_CLI:
            _add_field(train_fields, f.name, f.type, getattr(defaults, f.name), docs[f.name], valid.get(f.name))
    loss_fields = parser.add_argument_group("loss options (LossOptions fields; defaults: the grpo preset's)")
    taken = {f.name for f in dataclasses.fields(TrainConfig)}
    loss_docs = field_docs(LossOptions)
    for f in dataclasses.fields(LossOptions):
        if f.name not in PER_STEP_LOSS_OPTIONS and f.name not in taken:
            default = getattr(defaults.loss, f.name)
            _add_field(loss_fields, f.name, f.type, default, loss_docs.get(f.name, ""), valid.get(f.name))
    return parser


def yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping in YAML file `path` (empty: {}); a ValueError naming the file otherwise."""
    data = read_yaml(path) or {}
    if not isinstance(data, Mapping):
        raise TypeError(f"{path}: must be a mapping of TrainConfig fields, got {type(data).__name__}")
    return dict(data)


def _read_yaml(config_file: str | None) -> dict[str, Any]:
    if config_file is None:
        return {}
    if not Path(config_file).is_file():
        raise FileNotFoundError(f"--config {config_file}: no such file")
    return yaml_mapping(Path(config_file))


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line: defaults < --preset < --config YAML < flags, checked (`check_config`).
    With `--resume`, the run's `config.yaml` in the output directory replaces the defaults, so the run continues
    with its own configuration; the trainer then refuses any difference outside `run_dir.RESUMABLE`."""
    args = vars(build_parser().parse_args(argv))
    args.pop("debug", None)
    config_file = args.pop("config_file", None)
    data = _read_yaml(config_file)
    config = TrainConfig()
    if args.get("resume", data.get("resume", False)):
        from grpo_kernels.trainer.run_dir import load_run_config

        output_dir = args.get("output_dir", data.get("output_dir"))
        if output_dir is None:
            raise run_names.resume_needs_output_dir()
        config = load_run_config(output_dir) or config
    preset_given = "preset" in args or "preset" in data
    paper_settings = args.get("paper_settings", data.get("paper_settings", False))
    if preset_given or paper_settings:
        config = apply_preset(config, args.get("preset", data.get("preset", config.preset)), paper_settings)
    in_yaml = {k: v for k, v in data.items() if k not in ("preset", "paper_settings")}
    config = from_dict(in_yaml, config, where=str(config_file))
    loss_names = {f.name for f in dataclasses.fields(LossOptions)} - {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {k: v for k, v in args.items() if k not in loss_names and k not in ("preset", "paper_settings")}
    loss_flags = {k: v for k, v in args.items() if k in loss_names}
    config = from_dict({**flags, "loss": loss_flags or None}, config, where="command line")
    in_file = {*data, *(["temperature"] if "temperature" in (data.get("loss") or {}) else [])}
    given = {n: "config file" for n in TRAINING_SETTINGS if n in in_file}
    given.update({n: "flag" for n in TRAINING_SETTINGS if n in args})
    config = dataclasses.replace(config, sources={**config.sources, **given})
    check_config(config)
    return run_names.with_output_dir(run_names.capped_steps(config), preset_given)

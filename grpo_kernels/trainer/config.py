"""TrainConfig: every trainer option once, with its default; the defaults run the CPU demo.

The command line is generated from the fields: `--output-dir runs/x` (or `--output_dir`), `--steps 100`,
`--resume` / `--no-resume`; the loss options are `LossOptions`' own fields, flat (`--loss-type dapo`, `--beta 0.04`,
`--epsilon-high 0.28`). `None` is written `none`. Precedence, lowest first: the defaults, a paper preset (`--preset
dapo`: its loss options and advantage estimator here; its rewards, with `math_answer` standing for the task's
reward, its sampler and its regularizers are built by the trainer, `components.py`), a YAML file (`--config
file.yaml`: TrainConfig fields as keys, loss options under `loss:`), then the flags.
The default preset is `grpo` (DeepSeekMath: ε = 0.2, β = 0.04 with the k3 estimator against a frozen reference,
group z-score advantages), so the demo shows a KL; `--preset none` starts from `LossOptions()` (TRL's defaults).
`TrainConfig.max_completion_length` is the generation budget and, unless `loss.max_completion_length` is set, also
Dr.GRPO's normaliser (as in TRL).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_kernels import presets
from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.components import ADVANTAGE_INPUTS, missing_advantage_inputs

PER_STEP_LOSS_OPTIONS = ("num_items_in_batch", "num_sequences_in_batch")  # set by the trainer at each step
DEFAULT_PRESET = "grpo"


@dataclass
class TrainConfig:
    """Options of `grpo_kernels.trainer.train`; the defaults train the tiny demo policy on CPU in a few minutes."""

    # run
    output_dir: str = "runs/demo"  # metrics.jsonl, metrics.png, config.yaml, checkpoints/
    seed: int = 0
    steps: int = 600  # optimizer steps of the outer loop (each: one rollout batch, num_iterations updates)
    resume: bool = False  # continue from the latest checkpoint in output_dir
    checkpoint_every: int = 200  # steps between checkpoints (step 0, the initial policy, too); 0 = only the last
    eval_every: int = 25  # steps between greedy evaluations on every prompt of the task; the last step always
    device: str = "auto"  # "auto": cuda when available (under torchrun: cuda:LOCAL_RANK), else cpu
    parallel: str = "auto"  # under torchrun: "ddp" (auto) or "fsdp" (FSDP2); "none" for one process
    report_to: str = "none"  # "tensorboard" or "wandb" besides the JSONL (needs the package)
    torch_threads: int | None = 1  # CPU threads of torch ops (None: torch's default); 1 is fastest for tiny models
    # policy
    model: str = "tiny"  # "tiny": a Llama built from the three sizes below; else a Hugging Face name or local path
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    lora: bool = False  # train LoRA adapters (peft) instead of every weight
    lora_r: int = 16
    lora_alpha: int = 32
    lora_target_modules: str = "all-linear"  # peft's target_modules: a comma-separated list or "all-linear"
    # data
    dataset: str = "addition"  # "addition" (generated), "countdown" (generated), "gsm8k", or a path to a .jsonl
    max_sum: int = 9  # addition: prompts a+b= with single digits and a + b <= max_sum (9: one-digit answers)
    eval_size: int = 256  # at most this many held-out prompts per evaluation
    # rollout
    rollout: str = "hf"  # "hf" (transformers generate) or "vllm" (colocated vLLM; CUDA)
    prompts_per_step: int = 16
    num_generations: int = 16  # G completions per prompt (TRL's name)
    max_completion_length: int | None = None  # generation budget in tokens (TRL's name); None: the dataset's
    # (addition 3, countdown 16, gsm8k 256, jsonl 64)
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = True
    vllm_importance_sampling_correction: bool = True  # TRL's names and defaults from here on
    vllm_importance_sampling_mode: str = "sequence_mask"  # token_truncate, token_mask, sequence_truncate, sequence_mask
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    # algorithm
    preset: str | None = DEFAULT_PRESET  # paper preset (configs/papers/<name>.yaml) or preset YAML: the trainer
    # builds its rewards, sampler and regularizers; its loss options and advantage come in through `apply_preset`
    # (the command line's `--preset` calls it; setting this field alone does not change `loss` or `advantage`)
    advantage: str = "grpo"  # an ADVANTAGES name
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)  # its hyperparameters
    num_iterations: int = 1  # μ: optimizer updates per rollout batch (TRL's name)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer update on each rank (TRL's name)
    learning_rate: float = 1.0e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    sync_ref_model: bool = False  # refresh the reference model from the policy (TR-DPO mixing, TRL's names)
    ref_model_sync_steps: int = 512
    ref_model_mixup_alpha: float = 0.6
    loss: LossOptions = field(default_factory=lambda: presets.load(DEFAULT_PRESET).loss)  # the preset's
    # logging
    progress: bool = True  # live progress bar (rich, else tqdm)
    plot: bool = True  # metrics.png at the end (needs matplotlib)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML-able); `from_dict` gives the config back."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "loss"}
        data["loss"] = {f.name: getattr(self.loss, f.name) for f in dataclasses.fields(LossOptions)}
        for name in PER_STEP_LOSS_OPTIONS:
            data["loss"].pop(name)
        return data


def loss_options(config: TrainConfig) -> LossOptions:
    """The loss options the trainer uses: `config.loss`, with Dr.GRPO's constant defaulting to the budget."""
    if config.loss.max_completion_length is not None:
        return config.loss
    return dataclasses.replace(config.loss, max_completion_length=config.max_completion_length)


def advantage_function(config: TrainConfig) -> Callable[..., Any]:
    """The ADVANTAGES estimator `config.advantage`, called as fn(rewards, group_ids, **inputs, **advantage_kwargs).

    The trainer passes the per-step inputs the estimator names (`components.ADVANTAGE_INPUTS`: correctness, lengths,
    mean_logp, entropy, mask; GDPO's reward matrix). One that needs another (Stratified-GRPO's `strata`, PVPO's
    `reference_value`) and does not get it from `advantage_kwargs` is a ValueError here, before any work.
    """
    fn = ADVANTAGES.get(config.advantage)
    missing = missing_advantage_inputs(fn, config.advantage_kwargs)
    if missing:
        preset = f" (preset {config.preset!r})" if config.preset is not None else ""
        raise ValueError(
            f"advantage {config.advantage!r}{preset} needs per-step inputs {missing} that the trainer cannot produce "
            f"(it supplies rewards, group_ids and {list(ADVANTAGE_INPUTS)})"
        )
    return fn


def from_dict(data: Mapping[str, Any], base: TrainConfig | None = None, where: str = "config") -> TrainConfig:
    """`base` (default: the defaults) with the given fields replaced; `loss` is a mapping of loss options."""
    config = base or TrainConfig()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(fields)}")
    values = {k: v for k, v in data.items() if k != "loss"}
    loss = config.loss
    if data.get("loss") is not None:
        if not isinstance(data["loss"], Mapping):
            raise TypeError(f"{where}: loss must be a mapping of loss options, got {data['loss']!r}")
        loss_fields = {f.name: getattr(loss, f.name) for f in dataclasses.fields(LossOptions)}
        loss = LossOptions.from_kwargs(**{**loss_fields, **data["loss"]})
    return dataclasses.replace(config, **values, loss=loss)


def apply_preset(config: TrainConfig, name: str | None) -> TrainConfig:
    """The config with a paper preset's loss options and advantage estimator, and `preset` naming it: the trainer
    builds the preset's rewards, sampler and regularizers from that name (`components.PresetComponents`).
    `None`: LossOptions' defaults, the `grpo` advantage with its defaults, and the task's reward alone."""
    if name is None:
        return dataclasses.replace(config, preset=None, loss=LossOptions(), advantage="grpo", advantage_kwargs={})
    preset = presets.load(name)
    return dataclasses.replace(
        config,
        preset=name,
        loss=preset.loss,
        advantage=preset.advantage.name,
        advantage_kwargs=dict(preset.advantage.kwargs),
    )


# --------------------------------------------------------------------------------------------------- command line
def _converter(annotation: str):
    """A string -> value function for a field's annotation (`int`, `float | None`, `dict[str, Any]`, ...)."""
    parts = [p.strip() for p in annotation.split("|")]
    nullable = "None" in parts
    base = next(p for p in parts if p != "None")
    parse = {"int": int, "float": float, "str": str}.get(base, yaml.safe_load)

    def convert(text: str):
        if nullable and text.lower() in ("none", "null"):
            return None
        return parse(text)

    convert.__name__ = base  # argparse names the type in its errors
    return convert


def _add_field(parser: argparse.ArgumentParser, name: str, annotation: str, default: Any, help_text: str) -> None:
    flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
    help_text = f"{help_text} (default: {default!r})"
    if annotation == "bool":
        parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
    else:
        parser.add_argument(*flags, dest=name, type=_converter(annotation), metavar=name.upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_kernels.train",
        description="GRPO with the fused kernels. No arguments: the embedded CPU demo (tiny Llama, digit addition).",
        argument_default=argparse.SUPPRESS,  # only the flags given come back, so they override preset and YAML
    )
    parser.add_argument("--config", dest="config_file", metavar="YAML", help="a YAML file of TrainConfig fields")
    train_fields = parser.add_argument_group("trainer")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name != "loss":
            _add_field(train_fields, f.name, f.type, getattr(defaults, f.name), "TrainConfig." + f.name)
    loss_fields = parser.add_argument_group("loss options (LossOptions fields)")
    taken = {f.name for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(LossOptions):
        if f.name not in PER_STEP_LOSS_OPTIONS and f.name not in taken:
            _add_field(loss_fields, f.name, f.type, getattr(defaults.loss, f.name), "LossOptions." + f.name)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line: defaults < --preset < --config YAML < flags."""
    args = vars(build_parser().parse_args(argv))
    data: dict[str, Any] = {}
    config_file = args.pop("config_file", None)
    if config_file is not None:
        data = yaml.safe_load(Path(config_file).read_text(encoding="utf-8")) or {}
        if not isinstance(data, Mapping):
            raise TypeError(f"{config_file}: must be a mapping of TrainConfig fields, got {type(data).__name__}")
    config = TrainConfig()
    if "preset" in args or "preset" in data:
        config = apply_preset(config, args["preset"] if "preset" in args else data["preset"])
    config = from_dict({k: v for k, v in data.items() if k != "preset"}, config, where=str(config_file))
    loss_names = {f.name for f in dataclasses.fields(LossOptions)} - {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {k: v for k, v in args.items() if k not in loss_names and k != "preset"}
    loss_flags = {k: v for k, v in args.items() if k in loss_names}
    return from_dict({**flags, "loss": loss_flags or None}, config, where="command line")

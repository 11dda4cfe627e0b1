"""The GRPO loop, top to bottom: prompts -> G rollouts -> rewards -> advantages -> old / reference log-probs
(forward-only) -> μ fused-loss updates -> weight sync -> log -> eval -> checkpoint.

Each stage is one call into a sibling module; nothing here depends on the loss type or the advantage estimator,
which are configuration (`TrainConfig.loss`, `TrainConfig.advantage`, or a `--preset`).
"""

from __future__ import annotations

import random
import time

import torch

from grpo_kernels.trainer import checkpoint
from grpo_kernels.trainer.config import TrainConfig, advantage_function, loss_options
from grpo_kernels.trainer.evaluate import evaluate
from grpo_kernels.trainer.logging import MetricsLogger
from grpo_kernels.trainer.model import TINY, load_policy
from grpo_kernels.trainer.ref_model import build_ref_model, sync_ref_model
from grpo_kernels.trainer.rollout import HFRollout, Rollout
from grpo_kernels.trainer.tasks import PromptStream, build_task
from grpo_kernels.trainer.update import forward_logprobs, inner_updates, sampler_correction


def build_rollout(config: TrainConfig, model, tokenizer) -> Rollout:
    temperature = loss_options(config).temperature  # the loss's temperature is the sampler's
    if config.rollout == "hf":
        return HFRollout(model, tokenizer, config.max_completion_length, temperature)
    if config.rollout == "vllm":
        from grpo_kernels.trainer.vllm_rollout import VLLMRollout

        if config.model == TINY:
            raise ValueError("--rollout vllm needs --model <Hugging Face directory or hub name>; 'tiny' has none")
        return VLLMRollout(
            model,
            tokenizer,
            config.model,
            max_completion_length=config.max_completion_length,
            temperature=temperature,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enable_sleep_mode=config.vllm_enable_sleep_mode,
            seed=config.seed,
        )
    raise ValueError(f"rollout must be 'hf' or 'vllm', got {config.rollout!r}")


def train(config: TrainConfig) -> list[dict]:
    """Run `config.steps` GRPO steps (continuing from the latest checkpoint with `config.resume`); returns the
    metrics of every step, also written to `<output_dir>/metrics.jsonl`."""
    # ---- setup
    threads = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads or threads)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    options = loss_options(config)
    task = build_task(config)
    model, tokenizer = load_policy(config, task.alphabet, task.max_prompt_length)
    model.to(_device(config.device))
    ref_model = build_ref_model(model, options.beta)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    prompts = PromptStream(task, config.seed)
    advantage_fn = advantage_function(config)
    start = 0
    if config.resume and (latest := checkpoint.latest(config.output_dir)) is not None:
        state = checkpoint.load(latest, model, optimizer, ref_model)
        prompts.load_state_dict(state["data"])
        start = state["step"]
    rollout = build_rollout(config, model, tokenizer)
    checkpoint.save_config(config.output_dir, config.to_dict())
    logger = MetricsLogger(config.output_dir, config.steps, start, config.progress)

    for step in range(start + 1, config.steps + 1):
        tic = time.perf_counter()
        # ---- prompts -> G rollouts each
        batch_prompts = prompts.next(config.prompts_per_step)
        batch = rollout.generate([p.text for p in batch_prompts], config.num_generations)
        # ---- rewards -> advantages (group-relative; `rewards` and `advantages` stay separate)
        answers = [batch_prompts[i].answer for i in batch.group_ids.tolist()]
        scores = task.score(batch.completions, answers, batch.truncated)
        advantages = advantage_fn(scores.rewards, batch.group_ids.cpu(), **config.advantage_kwargs)  # [B] or [B, T]
        # ---- old-policy and reference log-probs: forward only, fused lm_head
        old_logp = forward_logprobs(model, batch, options.temperature)  # [B, T]
        ref_logp = forward_logprobs(ref_model, batch, options.temperature)  # [B, T] or None
        is_ratio = sampler_correction(old_logp, batch, config)  # [B, T], [B] or None: π_old / π_sampler
        # ---- μ inner updates with the fused loss (global token count)
        stats = inner_updates(
            model,
            optimizer,
            batch,
            advantages.to(old_logp.device),
            old_logp,
            ref_logp,
            is_ratio,
            options,
            config.num_iterations,
            config.max_grad_norm,
        )
        # ---- weight sync (sampler and reference)
        rollout.sync_weights()
        sync_ref_model(ref_model, model, step, config)
        # ---- log
        metrics = {**scores.metrics(batch.group_ids), **batch.metrics(), **stats}
        if is_ratio is not None:
            metrics["sampling/importance_sampling_ratio/mean"] = is_ratio.mean().item()
        # ---- eval
        if step == config.steps or (config.eval_every and step % config.eval_every == 0):
            metrics.update(evaluate(model, tokenizer, task, config.max_completion_length))
        metrics["step_time"] = time.perf_counter() - tic
        logger.log(step, metrics)
        # ---- checkpoint
        if step == config.steps or (config.checkpoint_every and step % config.checkpoint_every == 0):
            checkpoint.save(
                config.output_dir,
                step,
                model,
                tokenizer,
                optimizer,
                ref_model,
                prompts.state_dict(),
                config.to_dict(),
            )

    logger.close(plot=config.plot)
    torch.set_num_threads(threads)
    return logger.history


def _device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)

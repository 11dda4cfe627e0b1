"""Kept-set replay on vLLM's own sampling masks: the `vllm_mask` step of `benchmarks/run_gpu.sh` (run only when vLLM
is importable; `return_sampling_mask` needs Model Runner V2, i.e. a GPU).

A small Llama (random weights, the addition task's character tokenizer, written as a Hugging Face directory: the GPU
machine has no network) is sampled by vLLM in float32 with `return_sampling_mask=True` and processed log-probs, at
T 0.8 with top_k 20 and top_p 0.9 (vLLM requires top_k > 0 with masks). The same model in transformers, float32 on
the GPU, gives the trainer's logits of the sampled tokens; then, per token, against vLLM's processed log-prob:
- kept-set replay with vLLM's masks (`token_logprobs(..., sampling_mask=SamplingMask(...))`),
- rule replay (`top_k`, `top_p`) and how often its kept set is vLLM's mask exactly (the float64 oracle's rule),
- the full-vocabulary log-prob (the bias replay removes).
Fails when kept-set replay errs by more than 1e-3 or by more than the full-vocabulary log-prob. OUTDIR gets the
model and `summary.json`.

    python -m benchmarks.vllm_sampling_mask OUTDIR/vllm_mask [--prompts 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.vllm_train import write_model

RULE = dict(temperature=0.8, top_k=20, top_p=0.9)
LIMIT = 1e-3  # max |kept-set replay - vLLM's processed log-prob| (float32 on both sides)


def sample(model_dir: Path, prompts: list[list[int]], tokens: int) -> list:
    """vLLM's completions (token ids, processed log-prob of each, kept ids of each) of every prompt."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        return_sampling_mask=True,
        logprobs_mode="processed_logprobs",
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(max_tokens=tokens, logprobs=0, ignore_eos=True, seed=0, **RULE)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outputs]


def compare(model_dir: Path, prompts: list[list[int]], completions: list) -> dict:
    """The errors of each log-prob against vLLM's processed ones, and the rule's agreement with vLLM's masks."""
    from transformers import AutoModelForCausalLM

    import grpo_kernels as gk
    from grpo_kernels import reference

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    errors = {"kept_set": [], "rule": [], "full": []}
    same_set = total = 0
    for prompt, out in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + list(out.token_ids)], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
        targets = ids[0, len(prompt) :]  # [T]
        vllm_logp = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)])  # [T]
        kept = out.sampling_mask.token_ids  # T lists of kept ids
        offsets = torch.tensor([0, *torch.tensor([len(k) for k in kept]).cumsum(0).tolist()], device="cuda")
        mask = gk.SamplingMask(torch.tensor([i for k in kept for i in k], device="cuda", dtype=torch.int32), offsets)
        temperature = RULE["temperature"]
        ours = {
            "kept_set": gk.token_logprobs(logits, targets, temperature=temperature, sampling_mask=mask),
            "rule": gk.token_logprobs(logits, targets, **RULE),
            "full": gk.token_logprobs(logits, targets, temperature=temperature),
        }
        for name, logp in ours.items():
            errors[name].append((logp.cpu() - vllm_logp).abs().max().item())
        support = reference.sampler_support(reference.transformed_logits(logits, temperature=temperature), top_k=20,
                                            top_p=0.9).cpu()  # fmt: skip
        for position, ids_kept in enumerate(kept):
            total += 1
            same_set += set(support[position].nonzero().flatten().tolist()) == set(ids_kept)
    return dict(
        rule=RULE,
        tokens=total,
        max_abs_error={name: max(values) for name, values in errors.items()},
        rule_set_equals_vllm_mask=same_set / total,
        mean_kept=sum(len(k) for o in completions for k in o.sampling_mask.token_ids) / total,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    write_model(model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 14, (6,), generator=g).tolist() for _ in range(args.prompts)]
    summary = compare(model_dir, prompts, sample(model_dir, prompts, args.tokens))
    error = summary["max_abs_error"]
    problems = []
    if not error["kept_set"] <= LIMIT:
        problems.append(f"kept-set replay errs by {error['kept_set']:.3g} > {LIMIT}")
    if not error["kept_set"] < error["full"]:
        problems.append(f"kept-set replay ({error['kept_set']:.3g}) is no closer than full ({error['full']:.3g})")
    summary["problems"] = problems
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2), flush=True)
    for problem in problems:
        print(f"VLLM SAMPLING MASK FAILED: {problem}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

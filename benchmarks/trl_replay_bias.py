"""The truncated-sampling bias of TRL's vLLM importance-sampling ratio, measured with TRL's own code: stock
`trl.GRPOTrainer` against the drop-in `grpo_kernels.integrations.trl.GRPOTrainer` on the same truncated samples.

    python -m benchmarks.trl_replay_bias                  # the rules of docs/sampling_replay.md
    python -m benchmarks.trl_replay_bias --rules top_p    # one of them

A tiny Qwen2 (2 layers, H 32, the demo's 14-token character vocabulary, random weights with the lm_head scaled ×20 so
that its logits spread over a few nats) samples LENGTH tokens per prompt through TRL's `rollout_func`: each token from
softmax(logits / T) renormalised over the kept set of the float64 oracle's `sampler_support` (vLLM's order), with
that renormalised log-prob as the sampler's, which is what vLLM returns as processed logprobs. Each trainer then runs
TRL's `_generate_and_score_completions` as with vLLM (`use_vllm` set on the built trainer; vLLM itself is not
needed) and token-level importance sampling, and logs TRL's `sampling/importance_sampling_ratio/*`. Prints, per rule,
the mean kept mass S and both trainers' ratio statistics; the fraction outside [0.9, 1.1] is over every token.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

T_SAMPLE, LENGTH = 0.7, 8
PROMPTS = ["abc", "abc", "def", "def"]  # equal lengths: no left padding, so TRL's forward sees the sampler's context
HEAD_SCALE = 20.0
RATIO = "sampling/importance_sampling_ratio"
RULES = {  # name -> GRPOConfig fields of the sampler
    "top_p": dict(top_p=0.8),
    "top_k": dict(top_k=4),
    "top_k_top_p_min_p": dict(top_k=5, top_p=0.9, min_p=0.05),
    "generation_kwargs": dict(generation_kwargs={"top_k": 4}),  # TRL passes these over top_k / top_p / min_p
    "control": {},
}


def write_model(path: Path) -> Path:
    """The tiny Qwen2, seeded, as a Hugging Face directory (its tokenizer: `tokenizer()`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    chars = tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(chars),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=chars.pad_token_id,
        bos_token_id=chars.bos_token_id,
        eos_token_id=chars.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(path)
    return path


class TruncatedSampler:
    """A TRL `rollout_func`: LENGTH tokens per prompt, each drawn from softmax(logits / T) renormalised over the
    oracle's kept set, that renormalised log-prob as the sampler's; records each token's kept mass S."""

    def __init__(self, tokenizer, rule: dict, seed: int = 0):
        self.tokenizer, self.rule = tokenizer, rule
        self.generator = torch.Generator().manual_seed(seed)
        self.kept_mass: list[float] = []

    def __call__(self, prompts: list[str], trainer) -> dict:
        from grpo_kernels import reference

        prompt_ids, completion_ids, logprobs = [], [], []
        for prompt in prompts:
            ids, sampled, logps = self.tokenizer(prompt)["input_ids"], [], []
            with torch.no_grad():
                for _ in range(LENGTH):
                    logits = trainer.model(input_ids=torch.tensor([ids + sampled])).logits[0, -1]  # [V]
                    z = reference.transformed_logits(logits, temperature=T_SAMPLE)  # [V] float64
                    kept = reference.sampler_support(z, **self.rule)  # [V]
                    log_q = torch.log_softmax(z.masked_fill(~kept, -math.inf), dim=-1)  # [V]
                    token = int(torch.multinomial(log_q.exp(), 1, generator=self.generator))
                    sampled.append(token)
                    logps.append(float(log_q[token]))
                    self.kept_mass.append(float(torch.softmax(z, dim=-1)[kept].sum()))
            prompt_ids.append(ids)
            completion_ids.append(sampled)
            logprobs.append(logps)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def sample_and_score(drop_in: bool, model_dir: str, config: dict) -> tuple[dict, TruncatedSampler]:
    """TRL's `_generate_and_score_completions` of stock `trl.GRPOTrainer` (or, `drop_in`, the same trainer switched
    to the drop-in by `patch` once `use_vllm` is set, as a vLLM run builds it) on the sampler's batch, with
    token-level importance sampling (truncated above at TRL's 3); (the logged metrics, the sampler). `config`:
    GRPOConfig fields."""
    import datasets
    import trl

    from grpo_kernels.integrations import trl as grpo_kernels_trl
    from grpo_kernels.integrations import trl_replay

    args = trl.GRPOConfig(
        output_dir=str(Path(tempfile.gettempdir()) / "grpo_kernels_trl_replay_bias"),
        per_device_train_batch_size=len(PROMPTS),
        num_generations=2,
        max_completion_length=LENGTH,
        temperature=T_SAMPLE,
        vllm_importance_sampling_mode="token_truncate",
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        **config,
    )
    chars = tokenizer()
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = trl.GRPOTrainer(model_dir, reward_funcs=_length, args=args, train_dataset=dataset, processing_class=chars)
    sampler = TruncatedSampler(chars, trl_replay.sampling_rule(trainer.args))
    trainer.rollout_func = sampler
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.args.use_vllm = True  # the sampler is vLLM's (its order of min-p, top-k, top-p)
    if drop_in:
        grpo_kernels_trl.patch(trainer)
    trainer._last_loaded_step = trainer.state.global_step  # no weight sync: there is no vLLM
    trainer.model.train()  # a training batch (TRL logs under "train")
    trainer._metrics["train"].clear()
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
    if not trainer._metrics["train"][f"{RATIO}/mean"]:  # the drop-in skipped the old pass: its loss pass gives π_old
        trainer.current_gradient_accumulation_steps = 1
        trainer.compute_loss(trainer.model, output)
    return {name: values[-1] for name, values in trainer._metrics["train"].items() if values}, sampler


def tokenizer():
    """The demo's character-level tokenizer of the model."""
    from grpo_kernels.trainer.model import build_tokenizer

    return build_tokenizer("abcdefghij")


def _length(completions, **kwargs) -> list[float]:
    return [float(len(c)) for c in completions]


def measure(rules: list[str], model_dir: str) -> list[dict]:
    """Per rule: the mean kept mass and both trainers' ratio statistics (mean, min, max, outside [0.9, 1.1])."""
    rows = []
    for rule in rules:
        row = dict(rule=rule, config=RULES[rule])
        for name in ("stock", "drop_in"):
            metrics, sampler = sample_and_score(name == "drop_in", model_dir, RULES[rule])
            row["kept_mass"] = sum(sampler.kept_mass) / len(sampler.kept_mass)
            row["below_0.9"] = sum(s < 0.9 for s in sampler.kept_mass) / len(sampler.kept_mass)
            row["tokens"] = len(sampler.kept_mass)
            for stat in ("mean", "min", "max"):
                row[f"{name}_{stat}"] = metrics[f"{RATIO}/{stat}"]
            row[f"{name}_logp_difference"] = metrics["sampling/sampling_logp_difference/mean"]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as markdown. Stock TRL's ratio of each token is its kept mass S (tests/test_trl_replay.py holds it
    to 1e-4), so the share of its ratios outside [0.9, 1.1] is the share of tokens with S < 0.9."""
    lines = [
        f"| sampler (T = {T_SAMPLE}) | tokens | mean kept mass S | stock TRL 1.16 ratio: mean (min–max) | "
        "stock: outside [0.9, 1.1] | drop-in ratio: mean (min–max) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rule = ", ".join(f"{k}={v}" for k, v in r["config"].items()) or "none (the control)"
        lines.append(
            f"| {rule} | {r['tokens']} | {r['kept_mass']:.4f} | {r['stock_mean']:.4f} ({r['stock_min']:.3f}–"
            f"{r['stock_max']:.3f}) | {r['below_0.9']:.0%} | {r['drop_in_mean']:.6f} ({r['drop_in_min']:.6f}–"
            f"{r['drop_in_max']:.6f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(args.rules, str(write_model(Path(folder))))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

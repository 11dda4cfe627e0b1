"""The log-prob gap of the fused lm_head to a float64 head, per `head_precision`, on random and on peaked logits.

    python -m benchmarks.head_precision_gap [--tokens 256 --hidden 896 --vocab 151936 --seed 0]

Hidden states and weight are bf16 (a bf16 trainer); the reference is the float64 GEMM and log-softmax of those same
bf16 values, the head a float32 sampler approaches. Targets are sampled from the reference distribution, as a
rollout samples them. Two kinds of logits:
- random: hidden ~ N(0, 1), weight ~ N(0, 1/H) · 3 (logit std ≈ 3, no dominant token);
- peaked: each hidden state is aligned with 3 of 8 weight rows so that their logits are about 25, 24 and 23 while
  the rest stay near 0 (std ≈ 1): large logits, a confident but not certain next token, as a trained model's.
Prints a Markdown table: max and mean |logp − logp_float64| over the tokens (nats), and the fused pass's time
(forward only, this machine).
"""

from __future__ import annotations

import argparse
import time

import torch

import grpo_kernels as gk
from grpo_kernels.kernels.head_precision import HEAD_PRECISIONS

PEAK_ROWS = 8  # the weight rows the peaked hidden states align with
PEAK_LOGITS = (25.0, 24.0, 23.0)  # the aligned rows' logits (before noise)


def make(kind: str, tokens: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [N, H], weight [V, H]), both bf16."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g) * 3 / hidden**0.5
    if kind == "random":
        h = torch.randn(tokens, hidden, generator=g)
    else:
        h = 0.3 * torch.randn(tokens, hidden, generator=g)
        picks = torch.rand(tokens, PEAK_ROWS, generator=g).argsort(-1)  # [N, 8]: a random order of the rows
        for logit, rows in zip(PEAK_LOGITS, picks.T, strict=False):
            w = weight[rows]  # [N, H]
            h += w * (logit / (w * w).sum(-1, keepdim=True))  # nearly orthogonal rows: this row's logit ≈ `logit`
    return h.bfloat16(), weight.bfloat16()


def reference(h: torch.Tensor, w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [N] sampled from the float64 head, their float64 log-probs [N])."""
    logp = torch.log_softmax(h.double() @ w.double().T, -1)  # [N, V]
    targets = torch.multinomial(logp.exp(), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    return targets, logp.gather(-1, targets[:, None])[:, 0]


def gap_rows(tokens: int, hidden: int, vocab: int, seed: int) -> list[dict]:
    rows = []
    for kind in ("random", "peaked"):
        h, w = make(kind, tokens, hidden, vocab, seed)
        targets, expected = reference(h, w, seed)
        for precision in HEAD_PRECISIONS:
            start = time.perf_counter()
            logp = gk.fused_linear_token_logprobs(h, w, targets, head_precision=precision, backend="torch")
            seconds = time.perf_counter() - start
            gap = (logp.double() - expected).abs()
            rows.append(dict(logits=kind, head_precision=precision, max=gap.max().item(), mean=gap.mean().item(),
                             seconds=seconds))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = gap_rows(args.tokens, args.hidden, args.vocab, args.seed)
    print(f"N = {args.tokens}, H = {args.hidden}, V = {args.vocab}, bf16 hidden and weight, torch backend, CPU\n")
    print("| logits | head_precision | max gap (nats) | mean gap (nats) | forward (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['logits']} | {r['head_precision']} | {r['max']:.2e} | {r['mean']:.2e} | {r['seconds']:.2f} |")
    return rows


if __name__ == "__main__":
    main()

"""What `check_finite` costs: forward + backward of `grpo_loss` (logits) or `fused_linear_grpo_loss` (hidden +
lm_head) at N = 2,048 tokens, dapo with β = 0.04, with and without the checks in interleaved rounds (median), and
the checks' own O(N) work timed alone.

    python -m benchmarks.check_finite_cost --case logits --rounds 9
    python -m benchmarks.check_finite_cost --case linear --rounds 7

`--smoke` runs the same at B 2 × T 4, H 16, V 64 (a check that the command runs, nothing measured).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import grpo_kernels as gk
from grpo_kernels.engine import finite, sync
from grpo_kernels.engine.inputs import LossInputs, LossTensors
from grpo_kernels.engine.layout import lay_out
from grpo_kernels.options import LossOptions

SIZES = {"full": ((8, 256, 896), (32000, 151936)), "smoke": ((2, 4, 16), (64,))}  # (B, T, H), vocabularies


def make_step(case: str, V: int, B: int, T: int, H: int):
    """A closure `step(check) -> seconds` for one fwd + bwd, plus the inputs the checks look at."""
    targets = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.1  # [B, T]
    adv = torch.randn(B)
    if case == "logits":
        master = torch.randn(B, T, V)
        logits = master.clone().requires_grad_()
        with torch.no_grad():
            logp = gk.token_logprobs(master, targets)  # [B, T]

        def call(check: bool):
            with torch.no_grad():
                logits.copy_(master)  # the in-place backward consumed the buffer: restore it, untimed
            logits.grad = None
            start = time.perf_counter()
            out = gk.grpo_loss(logits, targets, adv, old, ref, mask, beta=0.04, backend="torch", check_finite=check)
            out.loss.backward()
            return time.perf_counter() - start

    else:
        hidden = torch.randn(B, T, H, requires_grad=True)
        weight = (torch.randn(V, H) / H**0.5).requires_grad_()
        with torch.no_grad():
            logp = gk.fused_linear_token_logprobs(hidden, weight, targets)  # [B, T]

        def call(check: bool):
            hidden.grad = weight.grad = None
            start = time.perf_counter()
            out = gk.fused_linear_grpo_loss(
                hidden, weight, targets, adv, old, ref, mask, beta=0.04, backend="torch", check_finite=check
            )
            out.loss.backward()
            return time.perf_counter() - start

    old, ref = logp + 0.1 * torch.randn(B, T), logp + 0.1 * torch.randn(B, T)
    return call, (targets, adv, old, ref, mask, logp)


def checks_alone(targets, adv, old, ref, mask, logp, repeats: int = 200) -> float:
    """Seconds per call of the checks' own work: the side inputs' value checks (read with one sync) and the row
    statistics."""
    given = LossTensors(targets=targets, mask=mask, advantages=adv, old_logp=old, ref_logp=ref)
    rows = torch.empty(*mask.shape, 1)  # [B, T, 1]: the layout reads the logits' shape only
    layout = lay_out(rows, targets, mask, None, vocab=1, check_finite=True, loss=True, linear=False)
    lse = torch.randn(mask.shape)
    start = time.perf_counter()
    for _ in range(repeats):
        sync.read_checks(LossInputs.of(given, layout, LossOptions(), check_finite=True)[1])
        finite.check_row_stats(lse, logp, mask, finite.RowCheck(zero_prob_ok=False))
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("logits", "linear"), default="logits")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a check that it runs)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    (B, T, H), vocabs = SIZES["smoke" if args.smoke else "full"]
    for V in vocabs:
        step, tensors = make_step(args.case, V, B, T, H)
        step(True), step(False)  # warm-up
        times = {True: [], False: []}
        for i in range(args.rounds):
            for check in (True, False) if i % 2 == 0 else (False, True):
                times[check].append(step(check))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        alone = checks_alone(*tensors, repeats=2 if args.smoke else 200)
        print(
            f"{args.case} V={V}: fwd+bwd median of {args.rounds}: check_finite=True {on * 1e3:.1f} ms, "
            f"False {off * 1e3:.1f} ms ({(on / off - 1) * 100:+.2f}%); the checks alone {alone * 1e6:.0f} us"
        )


if __name__ == "__main__":
    main()

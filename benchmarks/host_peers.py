"""The peers `benchmarks.host_overhead` times beside the four public functions, on the same tiny inputs: what each
call would cost without this package.

- eager: plain torch on the materialised logits (log_softmax, gather, TRL's loss algebra); no checks, no metrics.
- TRL 1.16: its fused LM head (`ChunkedLogProbFunction`) and, for the loss, `GRPOTrainer._compute_loss`'s algebra.
- Liger: its chunked fused-linear GRPO loss (CPU or CUDA), its Triton GRPO loss on the logits (CUDA only).

A peer whose package is missing is listed with the reason instead of a time.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import Tensor

from benchmarks import baselines

Peer = Callable[[list[Tensor], dict], object]  # (the call's leaves, the inputs) -> a loss, or (logp, entropy)


def _eager_logprobs(logits: Tensor, targets: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """log_softmax(logits) gathered at the targets and the entropy beside it, both differentiable: [B, T] each."""
    log_probs = torch.log_softmax(logits.float(), -1)  # [B, T, V]
    logp = log_probs.gather(-1, targets[..., None]).squeeze(-1) * mask  # [B, T]
    return logp, -(log_probs.exp() * log_probs).sum(-1) * mask  # [B, T] each


def _policy(x: dict) -> list[Tensor]:
    return [x[k] for k in ("advantages", "old_logp", "ref_logp", "mask")]


def peers(loss: dict, device: torch.device) -> dict[str, list[tuple[str, Peer, str | None]]]:
    """function -> [(peer, its call, why it cannot run here or None)]. `loss`: the loss options of the run."""
    why_not = {
        "TRL 1.16": None if importlib.util.find_spec("trl") else "not installed (pip install trl)",
        "Liger": None if importlib.util.find_spec("liger_kernel") else "not installed (pip install liger-kernel)",
    }
    liger_on_logits = why_not["Liger"] or (None if device.type == "cuda" else "its Triton loss needs CUDA")
    options = {k: v for k, v in loss.items() if k in ("loss_type", "epsilon_high", "beta")}

    def logits_of(leaves: list[Tensor]) -> Tensor:
        hidden, weight = leaves
        return hidden @ weight.T  # [B, T, V]

    return {
        "token_logprobs": [("eager", lambda lv, x: _eager_logprobs(lv[0], x["targets"], x["mask"]), None)],
        "fused_linear_token_logprobs": [
            ("eager", lambda lv, x: _eager_logprobs(logits_of(lv), x["targets"], x["mask"]), None),
            ("TRL 1.16", lambda lv, x: baselines.trl_logprobs(*lv, x["targets"], x["mask"]), why_not["TRL 1.16"]),
        ],
        "grpo_loss": [
            ("eager", lambda lv, x: baselines.naive_loss(lv[0], x["targets"], *_policy(x), **options), None),
            (
                "Liger",
                lambda lv, x: baselines.liger_triton_loss(lv[0], x["targets"], *_policy(x), **options),
                liger_on_logits,
            ),
        ],
        "fused_linear_grpo_loss": [
            ("eager", lambda lv, x: baselines.naive_loss(logits_of(lv), x["targets"], *_policy(x), **options), None),
            (
                "TRL 1.16",
                lambda lv, x: baselines.trl_loss(*lv, x["targets"], *_policy(x), **options),
                why_not["TRL 1.16"],
            ),
            (
                "Liger",
                lambda lv, x: baselines.liger_chunked_loss(*lv, x["targets"], *_policy(x), **options),
                why_not["Liger"],
            ),
        ],
    }

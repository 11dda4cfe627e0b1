"""The policy's optimizer: torch's AdamW, or, for float16 parameters, AdamW with float32 master weights and state.

AdamW kept in float16 destroys a model in one step: its `eps` (1e-8) rounds to 0 in float16 (the smallest
subnormal is 6e-8), so an element whose gradient is 0 gets 0 / 0 = NaN. `MasterWeightAdamW` keeps, per parameter, a
float32 copy of the weights and float32 moments (apex's and DeepSpeed's fp16 optimizers do the same), takes the
step there and writes the rounded result back into the float16 parameter. Its state lives in `optimizer.state[p]`
under the model's own parameters, so torch's distributed state-dict helpers checkpoint and resume it exactly.
bfloat16 keeps torch's AdamW, as Hugging Face's Trainer and TRL do for a model loaded in bfloat16: its `eps` and
its range are float32's.

torch's AdamW runs its fused kernel (one pass over each parameter, as Hugging Face's Trainer does by default,
`adamw_torch_fused`) where every parameter lives on a device that has it (`benchmarks/bench_one_pass.py` times the
trainer's step with it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW kernel runs


class MasterWeightAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), computed on float32 master
    weights and moments for low-precision parameters; the parameters hold the master weights rounded."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["master"] = param.detach().float().clone()
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = float(state["step"])
                grad = param.grad.float()
                master.mul_(1.0 - lr * decay)
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
                master.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
                param.copy_(master)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state to its parameter's dtype, with the float32 master weights
        and moments kept float32 (a float16 round trip would lose what they are kept for)."""
        kept = {pid: {k: v for k, v in s.items() if k != "step"} for pid, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for pid, param in zip(ids, params, strict=True):
            for key, value in kept.get(pid, {}).items():
                self.state[param][key] = value.detach().to(device=param.device, dtype=torch.float32, copy=True)


def build_optimizer(params: Iterable[Tensor], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW for `params`: float32 master weights and state when they are float16 (see the module docstring)."""
    params = list(params)
    if any(p.dtype == torch.float16 for p in params):
        return MasterWeightAdamW(params, lr=lr, weight_decay=weight_decay)
    fused = all(p.device.type in FUSED_ADAMW_DEVICES for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)

"""The two references `benchmarks.gpu_parity` measures every backend against: the float64 oracle
(`grpo_kernels.reference`, its vocabulary pass chunked over rows on the device, its loss algebra on the CPU) and the
plain same-dtype implementation (materialised logits, `torch.log_softmax`, autograd) whose error sets the tolerance
at real sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from unittest import mock

import torch

from grpo_kernels import reference

F64 = torch.float64


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if device().type == "cuda":
        torch.cuda.synchronize()


def oracle_chunk_rows(V: int, H: int = 0) -> int:
    """Rows per float64 oracle chunk: ~12 [rows, V] float64 temporaries (log-softmax and its autograd) in a third
    of the free device memory (CPU: 64 MiB)."""
    budget = min(torch.cuda.mem_get_info()[0] // 3, 24 << 30) if device().type == "cuda" else 64 << 20
    return max(1, budget // (8 * (12 * V + 2 * H)))


def oracle_forward(z_of: Callable[[slice], torch.Tensor], targets: torch.Tensor, chunk: int):
    """Float64 logp and entropy [n] of the kept rows, chunk by chunk (z_of(rows) -> float64 logits [rows, V])."""
    logp, entropy = [], []
    with torch.no_grad():
        for s in range(0, len(targets), chunk):
            lp, en = reference.token_logprobs(z_of(slice(s, s + chunk)), targets[s : s + chunk])
            logp.append(lp)
            entropy.append(en)
    return torch.cat(logp), torch.cat(entropy)


def oracle_backward(z_of, targets, g_logp, g_ent, chunk: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, float64 dL/dz) per chunk, for the upstream gradients g_logp, g_ent [n]."""
    for s in range(0, len(targets), chunk):
        rows = slice(s, s + chunk)
        z = z_of(rows).requires_grad_()
        lp, en = reference.token_logprobs(z, targets[rows])
        (grad,) = torch.autograd.grad((lp * g_logp[rows] + en * g_ent[rows]).sum(), z)
        yield rows, grad


def oracle_loss(logp64, ent64, inp: dict, options: dict):
    """reference.grpo_loss on the CPU, its vocabulary pass replaced by the chunked float64 one: (loss, metrics,
    dL/dlogp [n], dL/dH [n]) on the device."""
    B, T = inp["mask"].shape
    kept = inp["kept"].cpu()
    leaves = []
    for values in (logp64, ent64):
        leaf = torch.zeros(B * T, dtype=F64)
        leaf[kept] = values.cpu()
        leaves.append(leaf.view(B, T).requires_grad_())
    args = [inp[k].cpu() for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    with mock.patch.object(reference, "token_logprobs", lambda *_, **__: tuple(leaves)):
        loss, metrics = reference.grpo_loss(torch.empty(B, T, 0), *args, **options)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    g = [torch.zeros(B * T, dtype=F64) if x is None else x.flatten() for x in grads]
    return loss.detach(), metrics, g[0][kept].to(device()), g[1][kept].to(device())


def run_plain(op: str, inp: dict, options: dict) -> tuple[dict, dict]:
    """The plain same-dtype implementation on fresh leaves (the tolerance's yardstick): logits [kept, V] in the input
    dtype, `torch.log_softmax`, gather and entropy; the loss algebra of `oracle_loss` on those values; autograd.
    ({name: value}, {name: gradient}) as `run_ours` gives them."""
    fused = op.startswith("fused_linear")
    names = ("hidden", "weight") if fused else ("logits",)
    leaves = {k: inp[k].detach().requires_grad_() for k in names}  # no copy: nothing here writes into them
    kept, targets = inp["kept"], inp["targets"].flatten()[inp["kept"]]
    if fused:
        z = leaves["hidden"].flatten(0, -2)[kept] @ leaves["weight"].T  # [n, V]
    else:
        z = leaves["logits"].flatten(0, -2)[kept]  # [n, V]
    log_q = torch.log_softmax(z, -1)  # [n, V]
    logp = log_q.gather(1, targets[:, None]).squeeze(1)  # [n]
    entropy = -(log_q.exp() * log_q).sum(-1)  # [n]
    del z, log_q
    if op.endswith("grpo_loss"):
        loss, metrics, g_logp, g_ent = oracle_loss(logp.detach().double(), entropy.detach().double(), inp, options)
        values = {"loss": loss, **{f"metric {k}": v for k, v in metrics.items()}}
    else:
        g_logp, g_ent = inp["w_logp"].flatten()[kept], inp["w_ent"].flatten()[kept]
        values = {}
        for name, v in (("logp", logp), ("entropy", entropy)):
            values[name] = v.new_zeros(inp["mask"].numel()).index_copy(0, kept, v.detach())  # [B·T]
    grads = torch.autograd.grad((logp, entropy), list(leaves.values()), (g_logp.to(logp.dtype), g_ent.to(logp.dtype)))
    sync()
    return values, dict(zip([f"grad {k}" for k in leaves], grads, strict=True))


def fused_oracle_grads(z_of, oracle: dict, h64: torch.Tensor, w64: torch.Tensor, chunk: int) -> None:
    """dL/dhidden [n, H] and dL/dweight [V, H] in float64 from the chunked backward."""
    d_hidden, d_weight = torch.zeros_like(h64), torch.zeros_like(w64)
    for rows, grad in oracle_backward(z_of, oracle["targets"], oracle["g_logp"], oracle["g_ent"], chunk):
        d_hidden[rows] = grad @ w64
        d_weight.addmm_(grad.T, h64[rows])
    oracle.update(d_hidden=d_hidden, d_weight=d_weight)

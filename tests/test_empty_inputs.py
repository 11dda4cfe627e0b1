"""Empty batches: every token masked, B = 0 or T = 0, in all four public functions, padded and
packed, on every backend: loss 0 (log-probs 0 of shape [B, T]), metrics as grpo_loss gives them, and zero gradients
of the right shapes. Before, the fused lm_head raised `torch.cat(): expected a non-empty list of Tensors`."""

import pytest
import torch

import grpo_kernels as gk
from tests.conftest import BACKENDS, DEVICE

V, H = 37, 16
SHAPES = {"all_masked": (2, 3), "B0": (0, 3), "T0": (2, 0)}
LOSSES = {  # token-level (the fused epilogues and the 3-GEMM lm_head), sequence-level, per-sequence output
    "token": dict(loss_type="dapo", beta=0.04),
    "sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "sequence_losses": dict(loss_type="grpo", return_sequence_losses=True),
}


def make(B: int, T: int) -> dict:
    g = torch.Generator().manual_seed(0)
    d = {
        "logits": torch.randn(B, T, V, generator=g),
        "hidden": torch.randn(B, T, H, generator=g),
        "weight": torch.randn(V, H, generator=g),
        "bias": torch.randn(V, generator=g),
        "targets": torch.randint(0, V, (B, T), generator=g),
        "mask": torch.zeros(B, T, dtype=torch.bool),
        "advantages": torch.randn(B, generator=g),
        "old_logp": -torch.rand(B, T, generator=g),
        "ref_logp": -torch.rand(B, T, generator=g),
    }
    return {k: v.to(DEVICE) for k, v in d.items()}


def leaves(d: dict, names: tuple[str, ...]) -> list[torch.Tensor]:
    return [d[name].clone().requires_grad_() for name in names]


def assert_zero_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any(), p.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused_linear"])
def test_token_logprobs(fused_linear, shape, backend):
    B, T = SHAPES[shape]
    d = make(B, T)
    if fused_linear:
        params = leaves(d, ("hidden", "weight", "bias"))
        logp, entropy = gk.fused_linear_token_logprobs(
            params[0], params[1], d["targets"], bias=params[2], mask=d["mask"], with_entropy=True, backend=backend
        )
    else:
        params = leaves(d, ("logits",))
        logp, entropy = gk.token_logprobs(params[0], d["targets"], mask=d["mask"], with_entropy=True, backend=backend)
    for x in (logp, entropy):
        assert x.shape == (B, T) and x.dtype == torch.float32 and not x.any()
    (logp.sum() + entropy.sum()).backward()
    assert_zero_grads(params)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused_linear"])
def test_token_logprobs_of_no_rows(fused_linear, backend):
    """[N, ·] inputs with N = 0."""
    d = make(1, 0)
    targets = d["targets"][0]
    if fused_linear:
        params = leaves({"hidden": d["hidden"][0], "weight": d["weight"]}, ("hidden", "weight"))
        logp = gk.fused_linear_token_logprobs(*params, targets, backend=backend)
    else:
        params = leaves({"logits": d["logits"][0]}, ("logits",))
        logp = gk.token_logprobs(params[0], targets, backend=backend)
    assert logp.shape == (0,)
    logp.sum().backward()
    assert_zero_grads(params)


def grpo(fused_linear: bool, d: dict, backend: str, loss: str, **kw):
    """(output, the leaves) of grpo_loss / fused_linear_grpo_loss."""
    options = dict(LOSSES[loss])
    sequence_losses = options.pop("return_sequence_losses", False)
    args = (d["targets"], d["advantages"], d["old_logp"], d["ref_logp"], d["mask"])
    if fused_linear:
        params = leaves(d, ("hidden", "weight", "bias"))
        out = gk.fused_linear_grpo_loss(
            params[0],
            params[1],
            *args,
            bias=params[2],
            backend=backend,
            return_sequence_losses=sequence_losses,
            **options,
            **kw,
        )
    else:
        params = leaves(d, ("logits",))
        out = gk.grpo_loss(params[0], *args, backend=backend, return_sequence_losses=sequence_losses, **options, **kw)
    return out, params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused_linear"])
def test_grpo_loss(fused_linear, shape, loss, backend):
    B, T = SHAPES[shape]
    d = make(B, T)
    out, params = grpo(fused_linear, d, backend, loss)
    reference, _ = grpo(False, d, "torch", loss)  # grpo_loss on the torch backend: how an empty batch reads
    if loss == "sequence_losses":
        (out, sequence_losses), (reference, _) = out, reference
        assert sequence_losses.shape == (B,) and not sequence_losses.any()
    assert out.loss.dim() == 0 and out.loss == 0
    assert out.metrics.keys() == reference.metrics.keys()
    for name, value in out.metrics.items():  # (B = 0 with a sequence-level ratio: NaN means, losses/loss.py)
        torch.testing.assert_close(value, reference.metrics[name], rtol=0, atol=0, equal_nan=True, msg=name)
    out.loss.backward()
    assert_zero_grads(params)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [(0,), (0, 0), (2, 0, 3)], ids=["one_empty", "two_empty", "all_masked"])
@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused_linear"])
def test_packed(fused_linear, lengths, backend):
    """Packed sequences (cu_seqlens) with no token, or with every token masked."""
    N, S = sum(lengths), len(lengths)
    d = make(1, N)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    kw = dict(advantages=d["advantages"].new_ones(S), mask=d["mask"][0], cu_seqlens=cu_seqlens, backend=backend)
    targets = d["targets"][0]
    if fused_linear:
        params = leaves({"hidden": d["hidden"][0], "weight": d["weight"]}, ("hidden", "weight"))
        out = gk.fused_linear_grpo_loss(*params, targets, **kw)
    else:
        params = leaves({"logits": d["logits"][0]}, ("logits",))
        out = gk.grpo_loss(params[0], targets, **kw)
    assert out.loss == 0 and all(torch.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert_zero_grads(params)


@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused_linear"])
def test_module(fused_linear):
    d = make(0, 4)
    loss_fn = gk.GRPOLoss(loss_type="dapo")
    args = (d["targets"], d["advantages"], None, None, d["mask"])
    params = leaves(d, ("hidden", "weight") if fused_linear else ("logits",))
    out = loss_fn(*params, *args)
    out.loss.backward()
    assert out.loss == 0
    assert_zero_grads(params)

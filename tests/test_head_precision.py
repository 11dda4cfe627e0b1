"""`head_precision` of the fused lm_head against the float64 oracle (logits from the exact bf16 operands): with
"fp32"/"tf32" a bf16 head's log-probs and loss are float32-accurate on every route (row chunks with 3 or 4 GEMMs,
lean tiles, a vocabulary shard) and backend, and its gradients stay bf16 (the gradient GEMMs run in the weight's
dtype); "auto" keeps the bf16 rounding of the logits; "bf16" on a float32 head puts it there."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.kernels import head_precision
from tests.conftest import BACKENDS, assert_close
from tests.test_fused_linear import CHUNK, leaves, make, oracle

ROUTES = {  # name -> keywords of fused_linear_grpo_loss that pick the route
    "three_gemm": dict(loss_type="dapo", chunk_size=CHUNK),
    "four_gemm": dict(loss_type="grpo", importance_sampling_level="sequence", chunk_size=CHUNK),
    "lean": dict(loss_type="dapo", memory="lean", tile=(4, 16)),
}
LOSS_ARGS = ("targets", "advantages", "old_logp", "ref_logp", "mask")


def _oracle_logp(inputs: dict) -> torch.Tensor:
    p = leaves(inputs, double=True)
    logits = p["hidden"] @ p["weight"].T + p["bias"]
    return torch.log_softmax(logits, -1).gather(-1, inputs["targets"].cpu()[..., None])[..., 0]


def _logp_error(inputs: dict, precision: str, **route) -> float:
    logp = gk.fused_linear_token_logprobs(
        inputs["hidden"], inputs["weight"], inputs["targets"], bias=inputs["bias"], head_precision=precision, **route
    )
    mask = inputs["mask"].cpu()
    return (logp.cpu().double() - _oracle_logp(inputs))[mask].abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("route", [dict(chunk_size=CHUNK), dict(memory="lean", tile=(8, 16))], ids=["fast", "lean"])
def test_logprobs_of_a_bf16_head(backend, route):
    inputs = make(torch.bfloat16)
    precisions = head_precision.HEAD_PRECISIONS if backend == "torch" else ("auto", "fp32")  # the interpreter is slow
    errors = {p: _logp_error(inputs, p, backend=backend, **route) for p in precisions}
    for precision in {"fp32", "tf32"} & set(precisions):
        assert errors[precision] <= 1e-5, (precision, errors)
    assert errors["auto"] == errors.get("bf16", errors["auto"]) > 100 * errors["fp32"], errors  # bf16 logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("route", ROUTES)
def test_loss_and_gradients_of_a_bf16_head(backend, route):
    inputs = make(torch.bfloat16)
    options = dict(ROUTES[route], beta=0.04, epsilon_high=0.28)
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in LOSS_ARGS]
    out = gk.fused_linear_grpo_loss(
        p["hidden"], p["weight"], *args, bias=p["bias"], backend=backend, head_precision="fp32", **options
    )
    out.loss.backward()
    oracle_options = {k: v for k, v in options.items() if k not in ("chunk_size", "memory", "tile")}
    ref_loss, _, ref = oracle(inputs, **oracle_options)
    assert_close(out.loss, ref_loss, torch.float32, "loss")
    for name, x in p.items():
        assert x.grad.dtype == torch.bfloat16, name  # dH, dW and db in the weight's dtype
        assert_close(x.grad, ref[name].grad, torch.bfloat16, f"grad {name}")


def test_bf16_precision_on_a_float32_head():
    inputs = make(torch.float32)
    assert _logp_error(inputs, "auto") <= 1e-5
    rounded = _logp_error(inputs, "bf16")  # the operands cast to bf16: errors of bf16 size
    assert 1e-3 < rounded < 0.1
    p = leaves(inputs, double=False)
    out = gk.fused_linear_grpo_loss(
        p["hidden"], p["weight"], *[inputs[k] for k in LOSS_ARGS], bias=p["bias"], head_precision="bf16"
    )
    out.loss.backward()
    assert all(x.grad.dtype == torch.float32 for x in p.values())


def test_vocabulary_shard(tmp_path):
    """A 1-rank vocabulary shard (process_group): the shard route takes head_precision too."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        inputs = make(torch.bfloat16)
        shard = dict(process_group=dist.group.WORLD, vocab_start=0, chunk_size=CHUNK)
        assert _logp_error(inputs, "fp32", **shard) <= 1e-5
        assert _logp_error(inputs, "auto", **shard) > 1e-3
    finally:
        dist.destroy_process_group()


def test_module_passes_head_precision():
    inputs = make(torch.bfloat16)
    args = [inputs[k] for k in LOSS_ARGS]
    loss_fn = gk.GRPOLoss(loss_type="dapo", head_precision="fp32")
    out = loss_fn(inputs["hidden"], inputs["weight"], *args, bias=inputs["bias"])
    expected = gk.fused_linear_grpo_loss(
        inputs["hidden"], inputs["weight"], *args, bias=inputs["bias"], loss_type="dapo", head_precision="fp32"
    )
    assert torch.equal(out.loss, expected.loss)


@pytest.mark.parametrize("fn", ["fused_linear_token_logprobs", "fused_linear_grpo_loss"])
def test_bad_head_precision_raises_before_launch(fn, launches):
    inputs = make(torch.bfloat16)
    args = [inputs[k] for k in LOSS_ARGS][: 1 if fn == "fused_linear_token_logprobs" else 2]
    with pytest.raises(ValueError, match="head_precision must be one of"):
        getattr(gk, fn)(inputs["hidden"], inputs["weight"], *args, head_precision="fp16")
    assert not launches


@pytest.mark.parametrize("precision,flag", [("tf32", "tf32"), ("fp32", "ieee")])
def test_cuda_gemm_flag_set_inside_and_restored(precision, flag):
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with head_precision.gemm_precision(precision, torch.device("cuda")):
        assert matmul.fp32_precision == flag
    assert matmul.fp32_precision == before
    with head_precision.gemm_precision(precision, torch.device("cpu")):
        assert matmul.fp32_precision == before


def test_gap_benchmark_runs():
    """benchmarks/head_precision_gap.py at a tiny size: float32 logits much closer to the float64 head."""
    from benchmarks import head_precision_gap

    rows = head_precision_gap.main(["--tokens", "16", "--hidden", "32", "--vocab", "300"])
    gaps = {(r["logits"], r["head_precision"]): r["max"] for r in rows}
    for kind in ("random", "peaked"):
        assert gaps[kind, "fp32"] == gaps[kind, "tf32"] < gaps[kind, "auto"] / 100

"""fused_linear_* against the float64 oracle on logits = hidden @ W.T + b: loss, metrics and the gradients of
hidden, weight and bias, for every loss type and the options, both layouts, both backends, fp32 and bf16 (Triton
under its interpreter: the loss-type cells `triton_cells` names)."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.losses.epilogue import is_token_level
from grpo_kernels.options import TOKEN_LEVEL_ONLY_TYPES, LossOptions
from tests.conftest import BACKENDS, DEVICE, assert_close
from tests.helpers import backend_cells, first_of_each, quiet_options

B, T, H, V = 3, 5, 16, 37
CHUNK = 3  # kept rows per chunk: not a divisor of the kept-token count
DTYPES = (torch.float32, torch.bfloat16)


def make(dtype: torch.dtype, seed: int = 0, with_bias: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 2
    bias = torch.randn(V, generator=g) if with_bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[-1] = False  # a fully masked sequence
    with torch.no_grad():
        logits = hidden.to(dtype).double() @ weight.to(dtype).double().T + (0 if bias is None else bias.to(dtype))
        logp, _ = reference.token_logprobs(logits, targets)
    d = torch.randn(B, T, generator=g, dtype=torch.float64)
    inputs = {
        "hidden": hidden.to(dtype),
        "weight": weight.to(dtype),
        "bias": None if bias is None else bias.to(dtype),
        "targets": targets,
        "mask": mask,
        "advantages": torch.randn(B, generator=g),
        "old_logp": (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float(),
        "ref_logp": (logp + d.sign() * (0.2 + 0.3 * d.abs())).float(),
    }
    return {k: None if v is None else v.to(DEVICE) for k, v in inputs.items()}


def leaves(inputs: dict, double: bool) -> dict:
    out = {}
    for name in ("hidden", "weight", "bias"):
        x = inputs[name]
        out[name] = None if x is None else (x.double().cpu() if double else x).detach().clone().requires_grad_()
    return out


def oracle(inputs: dict, **options):
    p = leaves(inputs, double=True)
    logits = p["hidden"] @ p["weight"].T + (0 if p["bias"] is None else p["bias"])
    args = {
        k: None if inputs[k] is None else inputs[k].cpu()
        for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")
    }
    loss, metrics = reference.grpo_loss(logits, **args, **options)
    loss.backward()
    return loss, metrics, p


def naive(inputs: dict, **options):
    """Plain PyTorch in the input dtype: the lm_head GEMM's output rounded to it, then the exact loss."""
    p = leaves(inputs, double=False)
    logits = (p["hidden"] @ p["weight"].T + (0 if p["bias"] is None else p["bias"])).cpu().double()
    args = {
        k: None if inputs[k] is None else inputs[k].cpu()
        for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")
    }
    loss, metrics = reference.grpo_loss(logits, **args, **options)
    loss.backward()
    return loss, metrics, p


def check(ours_loss, ours_metrics, ours_params, inputs, dtype, **options):
    ref_loss, ref_metrics, ref_params = oracle(inputs, **options)
    naive_loss, naive_metrics, naive_params = naive(inputs, **options)
    assert_close(ours_loss, ref_loss, dtype, "loss", naive=naive_loss)
    for name, value in ours_metrics.items():
        assert_close(value, ref_metrics[name], dtype, name, naive=naive_metrics[name])
    for name, p in ours_params.items():
        if p is not None:
            assert p.grad is not None and p.grad.dtype == p.dtype, name
            assert_close(p.grad, ref_params[name].grad, dtype, f"grad {name}", naive=naive_params[name].grad)


TYPE_LEVELS = [
    (t, lv) for t in gk.LOSS_TYPES for lv in ("token", "sequence") if t not in TOKEN_LEVEL_ONLY_TYPES or lv == "token"
]


def type_level_options(loss_type: str, level: str) -> dict:
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, epsilon_high=0.28)
    if loss_type == "dr_grpo":
        options["max_completion_length"] = T + 2
    if loss_type == "dro":
        options["dro_beta"] = 0.3
    if loss_type == "clip_cov":  # cut every candidate, so the three calls below draw no differing random tokens
        options.update(clip_cov_ratio=1.0, clip_cov_lb=0.0)
    return options


def token_level(loss_type: str, level: str) -> bool:
    """Whether the fused lm_head forms this loss's gradients in its forward (`losses/epilogue.py`'s rule)."""
    return is_token_level(quiet_options(**type_level_options(loss_type, level)))


def triton_cells() -> list[tuple]:
    """The (dtype, loss type, IS level) cells Triton runs under its interpreter. The lm_head's loss is PyTorch on
    every route (the chunk loss or the two-phase algebra, checked on every cell by the torch backend); the Triton
    kernels see only a chunk's logits and dL/dlogp, dL/dentropy. So: each loss type and each IS level once, the dtypes
    taken in turn, and each route (gradients formed in the forward, or two-phase) in each dtype."""
    cells = [(DTYPES[i % len(DTYPES)], *cell) for i, cell in enumerate(first_of_each(TYPE_LEVELS))]
    for dtype in DTYPES:
        for route in (True, False):
            if not any(d == dtype and token_level(t, lv) == route for d, t, lv in cells):
                cells.append(next((dtype, t, lv) for t, lv in TYPE_LEVELS if token_level(t, lv) == route))
    return cells


LOSS_TYPE_CELLS = backend_cells(BACKENDS, [(dtype, t, lv) for dtype in DTYPES for t, lv in TYPE_LEVELS], triton_cells)


@pytest.mark.parametrize("backend,dtype,loss_type,level", LOSS_TYPE_CELLS, ids=lambda x: str(x).removeprefix("torch."))
def test_loss_types(backend, dtype, loss_type, level, launches):
    inputs = make(dtype)
    options = type_level_options(loss_type, level)
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    out = gk.fused_linear_grpo_loss(
        p["hidden"], p["weight"], *args, bias=p["bias"], chunk_size=CHUNK, backend=backend, with_entropy=True, **options
    )
    out.loss.backward()
    check(out.loss, out.metrics, p, inputs, dtype, **options)
    token_level = is_token_level(LossOptions(**options))
    assert launches["fused_linear_token_loss"] == int(token_level)  # gradients formed in the forward: 3 GEMMs
    chunks = -(-int(inputs["mask"].sum()) // CHUNK)
    assert launches[backend] == 2 * chunks  # forward and backward of each chunk of kept rows


OPTION_SETS = {
    "on_policy": dict(old_logp=None),
    "temperature_entropy_bonus": dict(temperature=0.7, entropy_coef=0.2),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    "dual_clip_k2": dict(clip_ratio_c=1.1, kl_estimator="k2", use_bias_correction_kl=True),
    "agg_mode": dict(loss_agg_mode="seq-mean-token-sum"),
    "weights": dict(token_weights=True, sequence_weights=True),
    "no_bias": dict(no_bias=True),
}


@pytest.mark.parametrize("option_set", OPTION_SETS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_options(backend, option_set):
    options = dict(OPTION_SETS[option_set], loss_type="dapo", beta=0.04)
    inputs = make(torch.float32, seed=3, with_bias=not options.pop("no_bias", False))
    if "old_logp" in options:
        inputs["old_logp"] = options.pop("old_logp")
    g = torch.Generator().manual_seed(4)
    weights = {}
    if options.pop("token_weights", False):
        weights["token_weights"] = (0.5 + torch.rand(B, T, generator=g)).to(DEVICE)
    if options.pop("sequence_weights", False):
        weights["sequence_weights"] = (0.5 + torch.rand(B, generator=g)).to(DEVICE)
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    out = gk.fused_linear_grpo_loss(
        p["hidden"], p["weight"], *args, bias=p["bias"], chunk_size=CHUNK, backend=backend, **weights, **options
    )
    out.loss.backward()
    check(
        out.loss,
        out.metrics,
        p,
        {**inputs, **weights},
        torch.float32,
        **options,
        **{k: v.cpu() for k, v in weights.items()},
    )


@pytest.mark.parametrize("no_grad", ("torch.no_grad", "no leaf requires grad"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_without_a_gradient_runs_no_backward(backend, no_grad, launches):
    """A token-level loss no gradient is asked of runs the forward pass alone (its backward half would be waste),
    with the loss and metrics of the call that takes the gradient."""
    inputs = make(torch.float32, seed=3)
    options = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    p = leaves(inputs, double=False)
    taken = gk.fused_linear_grpo_loss(p["hidden"], p["weight"], *args, bias=p["bias"], backend=backend, **options)
    assert launches["fused_linear_token_loss"] == 1
    launches.clear()
    if no_grad == "torch.no_grad":
        with torch.no_grad():
            out = gk.fused_linear_grpo_loss(p["hidden"], p["weight"], *args, bias=p["bias"], backend=backend, **options)
    else:
        plain = [inputs[k] for k in ("hidden", "weight", "bias")]
        out = gk.fused_linear_grpo_loss(*plain[:2], *args, bias=plain[2], backend=backend, **options)
    assert launches["fused_linear_token_loss"] == 0 and launches[backend] == 1  # one chunk, forward only
    assert not out.loss.requires_grad
    assert_close(out.loss, taken.loss.detach(), torch.float32, "loss")
    for name, value in out.metrics.items():
        assert_close(value, taken.metrics[name], torch.float32, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend):
    inputs = make(torch.float32, seed=5)
    present = inputs["mask"].clone()
    present[:, -1] = True
    present[-1, :2] = True  # sequence lengths 5, 5, 2 (the last one fully masked inside)
    lengths = present.sum(-1)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32, device=DEVICE), lengths.cumsum(0).int()])
    options = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp")]
    padded = leaves(inputs, double=False)
    out = gk.fused_linear_grpo_loss(
        padded["hidden"],
        padded["weight"],
        *args,
        inputs["mask"] & present,
        bias=padded["bias"],
        backend=backend,
        **options,
    )
    out.loss.backward()
    packed = leaves({**inputs, "hidden": inputs["hidden"][present]}, double=False)
    targets, advantages, old, ref = args
    out_packed = gk.fused_linear_grpo_loss(
        packed["hidden"],
        packed["weight"],
        targets[present],
        advantages,
        old[present],
        ref[present],
        inputs["mask"][present],
        bias=packed["bias"],
        cu_seqlens=cu_seqlens,
        backend=backend,
        **options,
    )
    out_packed.loss.backward()
    assert_close(out_packed.loss, out.loss, torch.float32, "loss")
    assert_close(packed["hidden"].grad, padded["hidden"].grad[present], torch.float32, "grad hidden")
    assert_close(packed["weight"].grad, padded["weight"].grad, torch.float32, "grad weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs(backend, dtype):
    inputs = make(dtype, seed=7)
    p = leaves(inputs, double=False)
    logp, ent = gk.fused_linear_token_logprobs(
        p["hidden"],
        p["weight"],
        inputs["targets"],
        bias=p["bias"],
        temperature=0.7,
        with_entropy=True,
        mask=inputs["mask"],
        chunk_size=CHUNK,
        backend=backend,
    )
    w = torch.randn(2, B, T, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    ((logp * w[0]).sum() + (ent * w[1]).sum()).backward()
    q = leaves(inputs, double=True)
    logits = q["hidden"] @ q["weight"].T + q["bias"]
    ref_logp, ref_ent = reference.token_logprobs(logits, inputs["targets"].cpu(), temperature=0.7)
    m = inputs["mask"].cpu().double()
    ((ref_logp * m * w[0].cpu()).sum() + (ref_ent * m * w[1].cpu()).sum()).backward()
    assert_close(logp, ref_logp * m, dtype, "logp")
    assert_close(ent, ref_ent * m, dtype, "entropy")
    for name in ("hidden", "weight", "bias"):
        assert_close(p[name].grad, q[name].grad, dtype, f"grad {name}")


def test_bad_weight_raises_before_launch(launches):
    inputs = make(torch.float32)
    args = [inputs[k] for k in ("targets", "advantages")]
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = 16"):
        gk.fused_linear_grpo_loss(inputs["hidden"], inputs["weight"][:, :8], *args)
    with pytest.raises(TypeError, match="weight dtype must match"):
        gk.fused_linear_grpo_loss(inputs["hidden"], inputs["weight"].double(), *args)
    with pytest.raises(ValueError, match=r"bias must be \[V\]"):
        gk.fused_linear_grpo_loss(inputs["hidden"], inputs["weight"], *args, bias=inputs["bias"][:-1])
    assert sum(launches.values()) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_takes_hidden_and_weight(backend):
    inputs = make(torch.float32, seed=9)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    module = gk.GRPOLoss(loss_type="dapo", beta=0.04, backend=backend, chunk_size=CHUNK)
    from_module = module(inputs["hidden"], inputs["weight"], *args, bias=inputs["bias"])
    from_function = gk.fused_linear_grpo_loss(
        inputs["hidden"],
        inputs["weight"],
        *args,
        bias=inputs["bias"],
        loss_type="dapo",
        beta=0.04,
        backend=backend,
        chunk_size=CHUNK,
    )
    assert torch.equal(from_module.loss, from_function.loss)

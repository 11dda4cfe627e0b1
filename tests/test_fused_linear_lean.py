"""memory="lean" (2-D tiles, vocabulary-major backward) against the float64 oracle and against memory="fast": loss,
every metric and the gradients of hidden, weight and bias, for every loss type × IS level × backend × dtype, with V
not a multiple of the vocabulary tile, row tiles that do not divide the kept rows and a fully masked sequence; the
per-token statistics and logit transforms; the tile budget, the "auto" rule and the argument checks."""

import functools
import warnings

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.engine import memory, validate
from grpo_kernels.kernels import fused_linear_lean
from tests.conftest import BACKENDS, DEVICE, assert_close
from tests.helpers import TRITON_INTERPRETED, first_of_each
from tests.test_fused_linear import DTYPES, TYPE_LEVELS, B, H, T, V, check, leaves, make

TILE = (4, 16)  # 4 rows (the kept rows: 10) × 16 columns (V = 37: tiles of 16, 16, 5)
TRITON_TILE = (16, 24)  # one row tile, vocabulary tiles of 24 and 13: fewer launches under the interpreter
LOSS_ARGS = ("targets", "advantages", "old_logp", "ref_logp", "mask")


def _loss(inputs: dict, memory: str, backend: str, tile=TILE, **options):
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in LOSS_ARGS]
    extra = dict(tile=tile) if memory == "lean" else dict(chunk_size=3)
    out = gk.fused_linear_grpo_loss(
        p["hidden"], p["weight"], *args, bias=p["bias"], memory=memory, backend=backend, with_entropy=True,
        **extra, **options,
    )  # fmt: skip
    out.loss.backward()
    return out, p


def _tiles(inputs: dict, tile) -> int:
    rows = -(-int(inputs["mask"].sum()) // tile[0])
    return rows * -(-V // tile[1])


def _options(loss_type: str, level: str) -> dict:
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, epsilon_high=0.28)
    if loss_type == "dr_grpo":
        options["max_completion_length"] = T + 2
    if loss_type == "dro":
        options["dro_beta"] = 0.3
    if loss_type == "clip_cov":  # cut every candidate: no random draw differs between the calls
        options.update(clip_cov_ratio=1.0, clip_cov_lb=0.0)
    return options


# The lean pass sees a loss only through dL/dlogp and dL/dentropy, so the matrix runs in full on the torch backend
# (each case also against memory="fast"); on Triton, whose launches are slow, every loss type × IS level runs in bf16
# (under the interpreter each loss type and each IS level once) and a token- and a sequence-level one in fp32 (the
# kernels see the dtype, not the loss).
CASES = [("torch", dtype, t, lv) for dtype in DTYPES for t, lv in TYPE_LEVELS]
CASES += [
    ("triton", torch.bfloat16, t, lv) for t, lv in (first_of_each(TYPE_LEVELS) if TRITON_INTERPRETED else TYPE_LEVELS)
]
CASES += [("triton", torch.float32, "dapo", "token"), ("triton", torch.float32, "grpo", "sequence")]


@pytest.mark.parametrize("backend,dtype,loss_type,level", CASES, ids=lambda x: str(x).removeprefix("torch."))
def test_loss_types(backend, dtype, loss_type, level, launches):
    inputs = make(dtype)
    options = _options(loss_type, level)
    tile = TILE if backend == "torch" else TRITON_TILE
    lean, p = _loss(inputs, "lean", backend, tile, **options)
    assert launches["fused_linear_token_loss"] == 0  # no gradient is formed in the forward
    assert launches[backend] == 2 * _tiles(inputs, tile)  # each tile once forward, once backward (the 4th GEMM)
    check(lean.loss, lean.metrics, p, inputs, dtype, **options)
    if backend != "torch":
        return
    fast, q = _loss(inputs, "fast", backend, **options)
    assert_close(lean.loss, fast.loss, dtype, "loss vs fast")
    for name, value in lean.metrics.items():
        assert_close(value, fast.metrics[name], dtype, f"{name} vs fast")
    for name in ("hidden", "weight", "bias"):
        assert p[name].grad.dtype == dtype
        assert_close(p[name].grad, q[name].grad, dtype, f"grad {name} vs fast")


def test_triton_equals_fast_with_row_tiles(launches):
    """Triton, several row and vocabulary tiles: lean equals fast (and the oracle) on loss, metrics and gradients."""
    inputs = make(torch.bfloat16, seed=2)
    options = _options("dapo", "token")
    lean, p = _loss(inputs, "lean", "triton", **options)
    check(lean.loss, lean.metrics, p, inputs, torch.bfloat16, **options)
    fast, q = _loss(inputs, "fast", "triton", **options)
    assert_close(lean.loss, fast.loss, torch.bfloat16, "loss vs fast")
    for name, value in lean.metrics.items():
        assert_close(value, fast.metrics[name], torch.bfloat16, f"{name} vs fast")
    for name in ("hidden", "weight", "bias"):
        assert_close(p[name].grad, q[name].grad, torch.bfloat16, f"grad {name} vs fast")


OPTION_SETS = {
    "temperature_entropy_bonus": dict(temperature=0.7, entropy_coef=0.2),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    "softcap_scale": dict(logit_scale=0.8, final_logit_softcapping=3.0),
    "weights": dict(token_weights=True, sequence_weights=True),
    "no_bias": dict(no_bias=True),
}


@pytest.mark.parametrize("option_set", OPTION_SETS)
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_options(backend, option_set):
    options = dict(OPTION_SETS[option_set], loss_type="dapo", beta=0.04)
    inputs = make(torch.float32, seed=3, with_bias=not options.pop("no_bias", False))
    g = torch.Generator().manual_seed(4)
    weights = {}
    if options.pop("token_weights", False):
        weights["token_weights"] = (0.5 + torch.rand(B, T, generator=g)).to(DEVICE).requires_grad_()
    if options.pop("sequence_weights", False):
        weights["sequence_weights"] = (0.5 + torch.rand(B, generator=g)).to(DEVICE)
    p = leaves(inputs, double=False)
    args = [inputs[k] for k in LOSS_ARGS]
    out = gk.fused_linear_grpo_loss(
        p["hidden"], p["weight"], *args, bias=p["bias"], memory="lean", backend=backend,
        tile=TILE if backend == "torch" else TRITON_TILE, **weights, **options,
    )  # fmt: skip
    out.loss.backward()
    ref = {k: v.detach().cpu() for k, v in weights.items()}
    check(out.loss, out.metrics, p, {**inputs, **weights}, torch.float32, **options, **ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_token_logprobs_and_stats(backend, dtype):
    """logp, entropy and the three statistics of the lean pass against float64 formulas, with soft-capping and a
    temperature; gradients of hidden, weight, bias through logp and entropy."""
    inputs = make(dtype, seed=7)
    p = leaves(inputs, double=False)
    transform = dict(temperature=0.7, logit_scale=1.3, final_logit_softcapping=4.0)
    stats = ("log_sum_sq_probs", "mean_logits", "is_top1")
    out = gk.fused_linear_token_logprobs(
        p["hidden"], p["weight"], inputs["targets"], bias=p["bias"], with_entropy=True, stats=stats,
        mask=inputs["mask"], memory="lean", tile=TILE if backend == "torch" else TRITON_TILE, backend=backend,
        **transform,
    )  # fmt: skip
    w = torch.randn(2, B, T, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    ((out["logp"] * w[0]).sum() + (out["entropy"] * w[1]).sum()).backward()
    q = leaves(inputs, double=True)
    x = q["hidden"] @ q["weight"].T + q["bias"]
    z = 4.0 * torch.tanh(1.3 * x / 4.0) / 0.7  # [B, T, V]
    log_q = z.log_softmax(-1)
    m = inputs["mask"].cpu()
    ref_logp = log_q.gather(-1, inputs["targets"].cpu()[..., None])[..., 0]
    ref_entropy = -(log_q.exp() * log_q).sum(-1)
    ((ref_logp * m * w[0].cpu()).sum() + (ref_entropy * m * w[1].cpu()).sum()).backward()
    assert_close(out["logp"], ref_logp * m, dtype, "logp")
    assert_close(out["entropy"], ref_entropy * m, dtype, "entropy")
    assert_close(out["log_sum_sq_probs"], (2 * log_q).logsumexp(-1) * m, dtype, "log_sum_sq_probs")
    assert_close(out["mean_logits"], z.mean(-1) * m, dtype, "mean_logits")
    if dtype == torch.float32:  # bf16 logits tie often: the first argmax of the float64 ones is another token
        top1 = z.argmax(-1) == inputs["targets"].cpu()
        assert torch.equal(out["is_top1"].cpu(), top1 & m)
    for name in ("hidden", "weight", "bias"):
        assert_close(p[name].grad, q[name].grad, dtype, f"grad {name}")


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_single_row_tile_and_default_tile(backend):
    """One row tile (dW in one GEMM per vocabulary tile) and the default tile give the oracle's numbers too."""
    for tile in ((64, 16), None):
        inputs = make(torch.bfloat16, seed=11)
        p = leaves(inputs, double=False)
        args = [inputs[k] for k in LOSS_ARGS]
        out = gk.fused_linear_grpo_loss(
            p["hidden"], p["weight"], *args, bias=p["bias"], memory="lean", tile=tile, backend=backend,
            loss_type="grpo", importance_sampling_level="sequence",
        )  # fmt: skip
        out.loss.backward()
        check(out.loss, out.metrics, p, inputs, torch.bfloat16, loss_type="grpo", importance_sampling_level="sequence")


def test_every_token_masked_gives_zero_gradients():
    inputs = make(torch.float32)
    inputs["mask"] = torch.zeros_like(inputs["mask"])
    out, p = _loss(inputs, "lean", "torch", loss_type="dapo")
    assert out.loss.item() == 0.0
    assert all(p[n].grad is not None and not p[n].grad.any() for n in ("hidden", "weight", "bias"))


def test_non_finite_row_is_named():
    inputs = make(torch.float32)
    inputs["hidden"][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"hidden @ weight.T \+ bias"):
        _loss(inputs, "lean", "torch", loss_type="dapo")


def test_cast_in_place_reuses_the_accumulator():
    acc = torch.randn(2500, 8)
    out = fused_linear_lean.cast_in_place(acc.clone(), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2500, 8)
    assert torch.equal(out, acc.bfloat16())


def test_tile_shape_from_budget_and_dtype():
    cpu = torch.device("cpu")
    rows, vocab = fused_linear_lean.tile_shape(2048, 151_936, 896, torch.float32, cpu, None)
    assert rows == 2048 and vocab % fused_linear_lean.TILE_VOCAB_ALIGN == 0
    assert rows * vocab * 4 <= fused_linear_lean.CPU_TILE_BYTES
    rows16, vocab16 = fused_linear_lean.tile_shape(2048, 151_936, 896, torch.bfloat16, cpu, None)
    assert rows16 == 2048 and rows16 * vocab16 * 6 <= fused_linear_lean.CPU_TILE_BYTES  # bf16 + its float32 copy
    rows16, vocab16 = fused_linear_lean.tile_shape(10**6, 151_936, 896, torch.bfloat16, cpu, None)
    assert rows16 * vocab16 * 6 + vocab16 * 896 * 4 <= fused_linear_lean.CPU_TILE_BYTES  # + the float32 dW tile
    big = fused_linear_lean.tile_shape(10**6, 151_936, 896, torch.float32, cpu, None)
    assert big == (fused_linear_lean.TILE_ROWS["cpu"], vocab)
    assert fused_linear_lean.tile_shape(7, 37, 16, torch.float32, cpu, (100, 16)) == (7, 16)


PLAN_V = 151_936
PLAN_DEVICES = {"cpu": (fused_linear_lean.TILE_ROWS["cpu"], True), "cuda": (fused_linear_lean.TILE_ROWS["cuda"], False)}


def _plan(n, hidden, dtype, budget, device):
    """The plan, and whether planning it warned (the once-per-figures cache cleared first)."""
    max_rows, upcast = PLAN_DEVICES[device]
    fused_linear_lean._warn_over_budget.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fused_linear_lean.plan_tiles(n, PLAN_V, hidden, dtype, budget, max_rows, upcast)
    return plan, [str(w.message) for w in caught]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("hidden", (896, 4096, 8192, 16384, 32768))
def test_tile_plan_never_degenerates(hidden, dtype):
    """Tiles of at least min(N, 128) rows × min(V, 128) columns; columns shrink first; buffers within the budget, or
    the minimum tile with one warning naming both figures; each dimension as large as the budget allows."""
    for device, (max_rows, upcast) in PLAN_DEVICES.items():
        for budget in (8 << 20, 16 << 20, 32 << 20, 64 << 20):
            for n in (1, 100, 8192, 65536):
                plan, warned = _plan(n, hidden, dtype, budget, device)
                case = f"{device} N={n} budget={budget}: {plan}"
                size = functools.partial(fused_linear_lean.tile_bytes, n=n, hidden=hidden, dtype=dtype, upcast=upcast)
                floor = size(min(n, 128), min(PLAN_V, 128))
                assert min(n, 128) <= plan.rows <= min(n, max(max_rows, 128)), case
                assert min(PLAN_V, 128) <= plan.columns <= PLAN_V, case
                assert plan.columns % 128 == 0 or plan.columns == PLAN_V, case
                assert plan.bytes == size(plan.rows, plan.columns) <= max(budget, floor), case
                assert plan.tiles == -(-n // plan.rows) * -(-PLAN_V // plan.columns), case
                if plan.rows < min(n, max_rows):  # rows were cut: only once the columns are at their minimum
                    assert plan.columns == 128, case
                    assert plan.rows == 128 or size(plan.rows + 128, 128) > budget, case
                elif plan.columns < PLAN_V:  # as many columns as fit
                    assert size(plan.rows, plan.columns + 128) > budget, case
                if plan.bytes > budget:
                    assert (plan.rows, plan.columns) == (min(n, 128), 128), case
                    assert len(warned) == 1 and f"{plan.bytes:,}" in warned[0] and f"{budget:,}" in warned[0], case
                else:
                    assert not warned, case


# (N, H, dtype, budget, device) -> (rows, columns, bytes, tiles per pass), V = 151,936
PLANS = {
    # the H100 note's case: a 1,024-column float32 dW tile (64 MiB) filled the budget, and the old planner fell to
    # 1-row tiles (65,536 × 149 ≈ 9.8 million of them); now the columns give way
    (65536, 16384, torch.bfloat16, 64 << 20, "cuda"): (16384, 640, 62_914_560, 952),
    (65536, 4096, torch.bfloat16, 64 << 20, "cuda"): (16384, 1280, 62_914_560, 476),
    (8192, 4096, torch.bfloat16, 64 << 20, "cuda"): (8192, 4096, 67_108_864, 38),  # one row tile: no dW tile
    (65536, 896, torch.float32, 32 << 20, "cpu"): (2048, 4096, 33_554_432, 1216),
    (65536, 8192, torch.bfloat16, 32 << 20, "cpu"): (2048, 640, 28_835_840, 7616),
    (100, 32768, torch.float32, 8 << 20, "cuda"): (100, 20864, 8_345_600, 8),
    (1, 32768, torch.bfloat16, 8 << 20, "cuda"): (1, 151_936, 303_872, 1),
    (65536, 32768, torch.float32, 8 << 20, "cuda"): (16384, 128, 8_388_608, 4748),
    (65536, 32768, torch.bfloat16, 8 << 20, "cuda"): (128, 128, 16_809_984, 607_744),  # over: the minimum tile
}


@pytest.mark.parametrize("case", PLANS, ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))
def test_tile_plans(case):
    n, hidden, dtype, budget, device = case
    plan, warned = _plan(n, hidden, dtype, budget, device)
    assert (plan.rows, plan.columns, plan.bytes, plan.tiles) == PLANS[case]
    assert bool(warned) == (plan.bytes > budget)


def test_over_budget_warns_once():
    fused_linear_lean._warn_over_budget.cache_clear()
    with pytest.warns(UserWarning, match=r"needs 16,809,984 bytes .* budget of 8,388,608 bytes") as caught:
        for _ in range(3):
            fused_linear_lean.plan_tiles(65536, PLAN_V, 32768, torch.bfloat16, 8 << 20, 16384, False)
    assert len(caught) == 1


def test_auto_rule(monkeypatch):
    """auto: fast while the float32 dW buffer and a chunk fit in half the free memory, else lean; a tile asks for
    lean, a chunk size for fast; fast inside a graph capture and on the cuda backend."""
    weight = torch.zeros(1000, 64)
    need = 1000 * 64 * 4 + memory.chunk_rows(100, 1000, 64, weight.device, None, weight.dtype) * 1000 * 4
    resolve = memory.resolve_memory
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * need)
    assert resolve("auto", "torch", 100, weight, None) == "fast"
    assert resolve("auto", "torch", 100, weight, None, (4, 16)) == "lean"
    assert resolve("lean", "torch", 100, weight, None) == "lean"
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * need - 2)
    assert resolve("auto", "torch", 100, weight, None) == "lean"
    assert resolve("auto", "torch", 100, weight, 8) == "fast"
    assert resolve("auto", "cuda", 100, weight, None) == "fast"
    assert resolve("fast", "torch", 100, weight, None) == "fast"
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # inside a graph capture
    assert resolve("auto", "triton", 100, weight, None) == "fast"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(memory="small"), "memory must be one of"),
        (dict(memory="lean", tile=(0, 16)), "tile must be"),
        (dict(memory="lean", tile=(4,)), "tile must be"),
        (dict(memory="lean", tile=(4.0, 16)), "tile must be"),
        (dict(memory="fast", tile=(4, 16)), "tile=.* got memory='fast'"),
        (dict(memory="lean", chunk_size=3), "chunk_size=3 sizes"),
    ],
)
def test_bad_arguments_raise_before_launch(kwargs, match, launches):
    inputs = make(torch.float32)
    args = [inputs[k] for k in LOSS_ARGS]
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_grpo_loss(inputs["hidden"], inputs["weight"], *args, **kwargs)
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_token_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"], **kwargs)
    assert sum(launches.values()) == 0


def test_module_passes_memory_and_tile():
    inputs = make(torch.float32, seed=9)
    args = [inputs[k] for k in LOSS_ARGS]
    module = gk.GRPOLoss(loss_type="dapo", beta=0.04, backend="torch", memory="lean", tile=TILE)
    from_module = module(inputs["hidden"], inputs["weight"], *args, bias=inputs["bias"])
    from_function = gk.fused_linear_grpo_loss(
        inputs["hidden"], inputs["weight"], *args, bias=inputs["bias"], loss_type="dapo", beta=0.04,
        backend="torch", memory="lean", tile=TILE,
    )  # fmt: skip
    assert torch.equal(from_module.loss, from_function.loss)
    assert "memory='lean'" in repr(module)


def test_lean_needs_a_tile_backend():
    with pytest.raises(ValueError, match="memory='lean' runs on backends 'torch' and 'triton', got backend='cuda'"):
        validate.check_memory("lean", None, None, "cuda")


@pytest.mark.parametrize("check_finite", (True, False), ids=("checks_on", "checks_off"))
@pytest.mark.parametrize("loss_type", ("dapo", "grpo"))
def test_host_reads_as_fast(loss_type, check_finite, monkeypatch):
    """The lean path reads the host as the fast one does (test_host_syncs): with the checks on, one batched read
    before the first kernel and one after the forward; off, only the kept-row count, and nothing when every row
    runs masked (as inside a CUDA graph capture), with the gathered path's numbers."""
    from grpo_kernels.engine import layout
    from tests.test_host_syncs import HostReads, _inputs

    inputs = _inputs()

    def step():
        hidden = inputs["hidden"].clone().requires_grad_()
        weight = inputs["weight"].clone().requires_grad_()
        args = (inputs["targets"], inputs["advantages"], inputs["old_logp"], None, inputs["mask"])
        out = gk.fused_linear_grpo_loss(
            hidden, weight, *args, memory="lean", tile=(3, 24), backend="triton", check_finite=check_finite,
            loss_type=loss_type, beta=0.0,
        )  # fmt: skip
        out.loss.backward()
        return out.loss, hidden.grad, weight.grad

    with HostReads() as host:
        gathered = step()
    assert len(host.reads) == (2 if check_finite else 1), host.reads
    if check_finite:
        return
    monkeypatch.setattr(layout, "all_rows", lambda check_finite, device: not check_finite)
    with HostReads() as host:
        every = step()
    assert host.reads == []
    for a, b in zip(every, gathered, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_float64_gradcheck():
    """The vocabulary-major backward is the derivative of the tiled forward (float64, soft-capped, entropy)."""
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in ((2, 3, 5), (11, 5), (11,))]
    targets = torch.randint(0, 11, (2, 3), generator=g)
    mask = torch.tensor([[True, True, False], [True, False, True]])

    def f(hidden, weight, bias):
        return gk.fused_linear_token_logprobs(
            hidden, weight, targets, bias=bias, mask=mask, with_entropy=True, temperature=0.7, logit_scale=1.2,
            final_logit_softcapping=2.0, memory="lean", tile=(2, 4), backend="torch",
        )  # fmt: skip

    assert torch.autograd.gradcheck(f, leaves)


def test_strided_inputs():
    """A transposed weight (tied embeddings) and a strided hidden view give the contiguous inputs' numbers."""
    inputs = make(torch.float32, seed=12)
    args = [inputs[k] for k in LOSS_ARGS]
    runs = []
    for strided in (False, True):
        hidden = inputs["hidden"].clone().requires_grad_()
        weight_t = inputs["weight"].T.contiguous().requires_grad_()  # [H, V]
        h = torch.cat([hidden, hidden], -1)[..., :H] if strided else hidden
        w = weight_t.T if strided else weight_t.T.contiguous()
        out = gk.fused_linear_grpo_loss(h, w, *args, memory="lean", tile=TILE, backend="torch", loss_type="dapo")
        out.loss.backward()
        runs.append((out.loss, hidden.grad, weight_t.grad))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b)

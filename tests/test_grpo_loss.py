"""grpo_loss against the float64 oracle: every loss type x IS level x backend x dtype, every option, every case (Triton
under its interpreter: the cells `triton_type_cells` names)."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.options import TOKEN_LEVEL_ONLY_TYPES
from tests.cases import CASE_IDS, CASES, Case
from tests.conftest import BACKENDS, DEVICE, DTYPES, assert_close
from tests.helpers import backend_cells, interpreted_cells, kernel_forms_loss, loss_inputs, ours_and_oracle

REQUIRED_METRICS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio/mean", "entropy"}


def type_options(loss_type: str, T: int) -> dict:
    """What a loss type needs beyond the defaults. clip_cov cuts every candidate (ratio 1), so the oracle, called
    after ours, cannot draw other tokens; its window admits some of the case's tokens. kl_cov penalises 2 of 8."""
    return {
        "dr_grpo": {"max_completion_length": T + 3},
        "clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.0},
        "kl_cov": {"kl_cov_ratio": 0.25},
        "dro": {"dro_beta": 0.3},
    }.get(loss_type, {})


def assert_matches(ours, oracle, dtype, expect_kl: bool) -> None:
    (loss, metrics, grad), (ref_loss, ref_metrics, ref_grad) = ours, oracle
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert_close(loss, ref_loss, dtype, "loss")
    assert_close(grad, ref_grad, dtype, "grad logits")
    assert REQUIRED_METRICS | ({"kl"} if expect_kl else set()) <= set(metrics)
    for name, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, name
        assert_close(value, ref_metrics[name], dtype, name)


# vespo, gspo_token and tic_grpo form their own sequence weight: LossOptions refuses them at the sequence level
TYPE_LEVELS = [
    (t, level)
    for t in gk.LOSS_TYPES
    for level in ("token", "sequence")
    if t not in TOKEN_LEVEL_ONLY_TYPES or level == "token"
]


def type_level_options(loss_type: str, level: str) -> dict:
    return dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        epsilon_high=0.28,
        **type_options(loss_type, Case("ragged_vocab").T),
    )


def triton_type_cells() -> list[tuple]:
    """The (dtype, loss type, IS level) cells Triton runs under its interpreter: `interpreted_cells` of the type x
    level matrix, a fused-epilogue cell in every dtype, a two-phase one in one dtype (taken in turn)."""
    cells, two_phase = [], 0
    for loss_type, level in interpreted_cells(
        TYPE_LEVELS, lambda t, lv: kernel_forms_loss("triton", **type_level_options(t, lv))
    ):
        if kernel_forms_loss("triton", **type_level_options(loss_type, level)):
            cells += [(dtype, loss_type, level) for dtype in DTYPES]
        else:
            cells.append((DTYPES[two_phase % len(DTYPES)], loss_type, level))
            two_phase += 1
    return cells


TYPE_CELLS = backend_cells(BACKENDS, [(dtype, t, lv) for dtype in DTYPES for t, lv in TYPE_LEVELS], triton_type_cells)


@pytest.mark.parametrize("backend,dtype,loss_type,level", TYPE_CELLS, ids=lambda x: str(x).removeprefix("torch."))
def test_loss_types(backend, dtype, loss_type, level, launches):
    options = type_level_options(loss_type, level)
    inputs = loss_inputs(Case("ragged_vocab"), dtype, DEVICE)
    ours, oracle = ours_and_oracle(inputs, backend, **options)
    assert_matches(ours, oracle, dtype, expect_kl=True)
    fused = level == "token" and gk.POLICY_LOSSES[loss_type].epilogue is not None  # every backend has an epilogue
    assert fused == kernel_forms_loss(backend, **options)
    assert launches == ({backend: 2, "fused_epilogue": 1} if fused else {backend: 2})


OPTION_SETS = {
    "on_policy": dict(old_logp=None),
    "per_token_advantages": dict(per_token_advantages=True),
    "delta": dict(delta=1.25, epsilon_high=0.2),
    "bias_corrected_kl": dict(beta=0.1, use_bias_correction_kl=True),
    "num_items_in_batch": dict(num_items_in_batch=23),
    "num_items_tensor": dict(num_items_in_batch=torch.tensor(23.0)),
    "is_ratio_per_token": dict(is_ratio="token"),
    "is_ratio_per_sequence": dict(is_ratio="sequence"),
    "top_entropy_quantile": dict(top_entropy_quantile=0.4),
    "temperature": dict(temperature=0.7),
    "sapo_temperatures": dict(sapo_temperature_pos=0.75, sapo_temperature_neg=1.25),
    "vespo_gamma": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
}


# delta applies to the clipped loss types only (LossOptions refuses it elsewhere, test_checks)
TYPE_OPTIONS = [
    (t, o)
    for t in ("grpo", "dapo", "cispo", "sapo", "vespo")
    for o in OPTION_SETS
    if o != "delta" or t in ("grpo", "dapo")
] + [("gmpo", o) for o in ("is_ratio_per_token", "is_ratio_per_sequence")]  # verl geo_mean's geometric mean


INPUT_OPTIONS = ("old_logp", "per_token_advantages", "is_ratio")  # the inputs an option set changes


def option_set_fused(loss_type: str, option_set: str) -> bool:
    options = {k: v for k, v in OPTION_SETS[option_set].items() if k not in INPUT_OPTIONS}
    return kernel_forms_loss("triton", **{"beta": 0.04, **options, "loss_type": loss_type})


# Under the interpreter Triton runs `interpreted_cells`: the fused-epilogue cells, each loss type and option set once
OPTION_CELLS = backend_cells(BACKENDS, TYPE_OPTIONS, lambda: interpreted_cells(TYPE_OPTIONS, option_set_fused))


@pytest.mark.parametrize("backend,loss_type,option_set", OPTION_CELLS)
def test_options(backend, loss_type, option_set, launches):
    options = dict(OPTION_SETS[option_set])
    case = Case("ragged_vocab")
    inputs = loss_inputs(
        case, torch.float32, DEVICE, seed=3, per_token_advantages=options.pop("per_token_advantages", False)
    )
    if "old_logp" in options:
        inputs["old_logp"] = options.pop("old_logp")
    if "is_ratio" in options:
        shape = (case.B, case.T) if options.pop("is_ratio") == "token" else (case.B,)
        inputs["is_ratio"] = (0.6 + 0.8 * torch.rand(shape, generator=torch.Generator().manual_seed(5))).to(DEVICE)
    temperature = options.pop("temperature", 1.0)
    options.setdefault("beta", 0.04)
    ours, oracle = ours_and_oracle(inputs, backend, temperature=temperature, loss_type=loss_type, **options)
    assert_matches(ours, oracle, torch.float32, expect_kl=True)
    if backend == "triton":
        assert launches["fused_epilogue"] == int(option_set_fused(loss_type, option_set)), "not the route expected"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hard_cases(backend, dtype, case):
    inputs = loss_inputs(case, dtype, DEVICE, seed=11)
    ours, oracle = ours_and_oracle(
        inputs,
        backend,
        temperature=case.temperature,
        loss_type="dapo",
        beta=0.04,
        epsilon_high=0.28,
        top_entropy_quantile=0.8,
    )
    assert_matches(ours, oracle, dtype, expect_kl=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_batch_gives_zero(backend):
    inputs = loss_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    inputs["mask"] = torch.zeros_like(inputs["mask"])
    (loss, metrics, grad), _ = ours_and_oracle(inputs, backend, loss_type="grpo", beta=0.04)
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_matches_function(backend):
    inputs = loss_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    module = gk.GRPOLoss(loss_type="dapo", epsilon_high=0.28, beta=0.04, backend=backend, inplace=False)
    from_module = module(inputs["logits"], *args)
    from_function = gk.grpo_loss(
        inputs["logits"], *args, loss_type="dapo", epsilon_high=0.28, beta=0.04, backend=backend
    )
    assert torch.equal(from_module.loss, from_function.loss)
    assert "dapo" in repr(module)

"""Bad input gets a clear ValueError/TypeError naming the argument, raised before any kernel launches."""

import os

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.kernels import backend as backends
from tests.cases import Case
from tests.conftest import DEVICE
from tests.helpers import loss_inputs


def _inputs():
    inputs = loss_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    return {k: inputs[k] for k in ("logits", "targets", "advantages", "old_logp", "ref_logp", "mask")}


def _bad(**changes):
    inputs = _inputs()
    inputs.update(changes)
    return inputs


B, T, V = 3, 5, 37
BAD_INPUTS = {
    "logits_2d": (lambda: _bad(logits=torch.randn(B, V)), ValueError, "logits must be"),
    "logits_int": (lambda: _bad(logits=torch.zeros(B, T, V, dtype=torch.int64)), TypeError, "logits dtype"),
    "logits_not_tensor": (lambda: _bad(logits=[[0.0]]), TypeError, "logits must be a torch.Tensor"),
    "targets_shape": (
        lambda: _bad(targets=torch.zeros(B, T - 1, dtype=torch.long)),
        ValueError,
        r"targets must be \[B, T\] = \[3, 5\], got \[3, 4\]",
    ),
    "targets_float": (lambda: _bad(targets=torch.zeros(B, T)), TypeError, "targets must be int64"),
    "targets_high": (
        lambda: _bad(targets=torch.full((B, T), V, dtype=torch.long)),
        ValueError,
        r"\[0, V\) = \[0, 37\)",
    ),
    "targets_negative": (
        lambda: _bad(targets=torch.full((B, T), -1, dtype=torch.long)),
        ValueError,
        "targets must lie",
    ),
    "mask_shape": (lambda: _bad(mask=torch.ones(B, T + 1, dtype=torch.bool)), ValueError, "mask must be"),
    "mask_values": (lambda: _bad(mask=torch.full((B, T), 0.5)), ValueError, "only 0 and 1"),
    "advantages_shape": (lambda: _bad(advantages=torch.zeros(B + 1)), ValueError, "advantages must be"),
    "advantages_int": (
        lambda: _bad(advantages=torch.zeros(B, dtype=torch.long)),
        TypeError,
        "advantages must be a floating",
    ),
    "old_logp_shape": (lambda: _bad(old_logp=torch.zeros(B)), ValueError, "old_logp must be"),
    "ref_logp_shape": (lambda: _bad(ref_logp=torch.zeros(B, T, 1)), ValueError, "ref_logp must be"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_tensor_raises_before_launch(name, backend, launches):
    make, error, message = BAD_INPUTS[name]
    with pytest.raises(error, match=message):
        gk.grpo_loss(**make(), backend=backend)
    assert sum(launches.values()) == 0


BAD_OPTIONS = {
    "unknown_option": (dict(eps=0.2), TypeError, "unknown loss option"),
    "unknown_loss_type": (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
    "unknown_level": (dict(importance_sampling_level="group"), ValueError, "importance_sampling_level"),
    "dr_grpo_needs_length": (dict(loss_type="dr_grpo"), ValueError, "max_completion_length"),
    "beta_needs_ref": (dict(beta=0.1, ref_logp=None), ValueError, "ref_logp is required"),
    "delta_on_sapo": (dict(loss_type="sapo", delta=2.0), ValueError, "delta applies"),
    "vespo_sequence": (dict(loss_type="vespo", importance_sampling_level="sequence"), ValueError, "vespo"),
    "temperature": (dict(temperature=0.0), ValueError, "temperature must be > 0"),
    "quantile": (dict(top_entropy_quantile=1.5), ValueError, "top_entropy_quantile"),
    "num_items": (dict(num_items_in_batch=0), ValueError, "num_items_in_batch"),
    "num_items_shape": (dict(num_items_in_batch=torch.ones(2)), ValueError, "num_items_in_batch"),
    "unknown_backend": (dict(backend="jax"), ValueError, "backend must be one of"),
    "cuda_backend": (dict(backend="cuda"), RuntimeError, r"grpo_kernels\._C|needs CUDA tensors"),
}


@pytest.mark.parametrize("name", BAD_OPTIONS)
def test_bad_option_raises_before_launch(name, launches):
    options, error, message = BAD_OPTIONS[name]
    inputs = _inputs()
    for key in ("ref_logp",):
        if key in options:
            inputs[key] = options.pop(key)
    with pytest.raises(error, match=message):
        gk.grpo_loss(**inputs, **options)
    assert sum(launches.values()) == 0


def test_options_object_and_keywords_are_exclusive():
    with pytest.raises(TypeError, match="not both"):
        gk.grpo_loss(**_inputs(), options=gk.LossOptions(), beta=0.1)


def test_token_logprobs_checks(launches):
    inputs = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        gk.token_logprobs(inputs["logits"], inputs["targets"], temperature=-1.0)
    with pytest.raises(ValueError, match="targets must be"):
        gk.token_logprobs(inputs["logits"], inputs["targets"][:, :2])
    assert sum(launches.values()) == 0


def test_padding_ids_outside_the_vocabulary_are_allowed_where_masked():
    inputs = _inputs()
    inputs["targets"][~inputs["mask"]] = -100  # an ignore index on padding is never read
    out = gk.grpo_loss(**inputs)
    assert torch.isfinite(out.loss)


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backends.resolve_backend("triton", torch.device("cpu"))


def test_float64_logits_are_for_the_torch_backend_only():
    with pytest.raises(TypeError, match="for backend='triton'"):
        gk.token_logprobs(
            torch.zeros(1, 2, 3, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.long), backend="triton"
        )


def test_chunk_size_must_be_positive():
    hidden, weight = torch.randn(1, 3, 4), torch.randn(7, 4)
    targets, adv = torch.randint(0, 7, (1, 3)), torch.randn(1)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int or None"):
            gk.fused_linear_token_logprobs(hidden, weight, targets, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size must be a positive int or None"):
            gk.fused_linear_grpo_loss(hidden, weight, targets, adv, chunk_size=bad)


def test_beta_and_num_items_must_be_sensible():
    with pytest.raises(ValueError, match="beta must be >= 0"):
        gk.LossOptions(beta=-1.0)
    with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
        gk.LossOptions(num_items_in_batch=float("nan"))

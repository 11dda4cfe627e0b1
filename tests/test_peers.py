"""Cross-check against Liger-Kernel's Triton GRPO loss (`triton_grpo_loss`): loss, logits gradient, its metrics
and its token log-probs, for every loss type both libraries implement, with the same options passed to both.

Liger's conventions: logits are `[B, T + 1, V]` (it drops the last position), advantages `[B]`, defaults
`temperature=0.9, beta=0.04, eps_high=0.4, loss_type="dapo", reduce=False` (all passed explicitly here), and with
`reduce=True` it returns `(loss, [kl_mean (when beta != 0), clip_ratio])`; `vllm_is_ratio` is our `is_ratio`.
"""

import dataclasses

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.options import TRL_LOSS_TYPES
from tests.cases import Case
from tests.conftest import BACKENDS, DEVICE, assert_close  # ahead of liger_kernel, which imports triton
from tests.helpers import loss_inputs

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install 'grpo-kernels[peers]')")

from liger_kernel.ops.grpo_loss import fused_selective_log_softmax  # noqa: E402
from liger_kernel.transformers.grpo_loss import triton_grpo_loss  # noqa: E402

pytestmark = pytest.mark.peers

F32 = torch.float32
CASE = Case("masked_row", B=3, T=5, V=131, temperature=0.9)  # one sequence fully masked, a few more tokens
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")  # the types Liger also runs at importance_sampling_level="sequence"
# luspo is compared only at sequence level without padding (test_luspo_without_padding), the one setting where
# Liger 0.8.5 matches TRL. TRL 1.16's luspo is (per_token_loss * mask).sum(-1).mean(), at sequence level
# mean_b(L_b * len_b); Liger averages its [B, T] per-token loss times the length over B * T, so each sequence
# weighs len_b² / T instead of len_b. At token level Liger's backward is wrong: it hands
# the kernel a [B, 1] upstream gradient with strides (1, 1), read as [b, t], i.e. at b + t, past the end for
# b + t >= B.


def liger_logits(logits: torch.Tensor) -> torch.Tensor:
    """Liger's `[B, T + 1, V]` layout: our logits plus a last position of NaN it must neither read nor use."""
    B, _, V = logits.shape
    return torch.cat([logits, torch.full((B, 1, V), float("nan"), dtype=logits.dtype, device=logits.device)], 1)


def ours_and_liger(inputs: dict, backend: str, options: gk.LossOptions, is_ratio: torch.Tensor | None = None):
    """(loss, metrics, logits grad) of our grpo_loss and (loss, metrics, grad of the first T positions) of Liger's."""
    logits = inputs["logits"].detach().clone().requires_grad_()
    peer_logits = liger_logits(inputs["logits"]).requires_grad_()
    out = gk.grpo_loss(
        logits,
        inputs["targets"],
        inputs["advantages"],
        inputs["old_logp"],
        inputs["ref_logp"],
        inputs["mask"],
        is_ratio=is_ratio,
        backend=backend,
        options=options,
    )
    out.loss.backward()
    mask = None if inputs["mask"] is None else inputs["mask"].int()  # TRL's completion_mask is an int tensor
    peer_loss, peer_metrics = triton_grpo_loss(
        peer_logits,
        inputs["old_logp"],
        inputs["ref_logp"],
        inputs["targets"],
        inputs["advantages"],
        mask,
        temperature=options.temperature,
        beta=options.beta,
        eps_low=options.epsilon,
        eps_high=options.clip_high,
        inplace=False,
        loss_type=options.loss_type,
        max_completion_length=options.max_completion_length,
        importance_sampling_level=options.importance_sampling_level,
        reduce=True,
        sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg,
        vllm_is_ratio=is_ratio,
        delta=options.delta,
        use_bias_correction_kl=options.use_bias_correction_kl,
        num_items_in_batch=options.num_items_in_batch,
        vespo_k_pos=options.vespo_k_pos,
        vespo_lambda_pos=options.vespo_lambda_pos,
        vespo_k_neg=options.vespo_k_neg,
        vespo_lambda_neg=options.vespo_lambda_neg,
    )
    peer_loss.backward()
    T = logits.shape[1]
    assert torch.count_nonzero(peer_logits.grad[:, T:]) == 0, "Liger's dropped last position has no gradient"
    return (out.loss, out.metrics, logits.grad), (peer_loss, peer_metrics, peer_logits.grad[:, :T])


def assert_matches_liger(ours, peer, options: gk.LossOptions) -> None:
    """Loss and gradient; Liger's kl mean; its clip ratio where it is TRL's token mean (token level, clipped types
    and cispo; for sapo/vespo, which TRL logs no clip ratio for, Liger reports 0)."""
    (loss, metrics, grad), (peer_loss, peer_metrics, peer_grad) = ours, peer
    assert_close(loss, peer_loss, F32, "loss")
    assert_close(grad, peer_grad, F32, "grad logits")
    if options.beta != 0.0:
        assert_close(metrics["kl"], peer_metrics[0], F32, "kl")
    if options.importance_sampling_level == "token" and options.loss_type not in ("sapo", "vespo"):
        name = "cispo_clip_ratio" if options.loss_type == "cispo" else "clip_ratio/region_mean"
        assert_close(metrics[name], peer_metrics[-1], F32, name)


def make_options(loss_type: str, **overrides) -> gk.LossOptions:
    """The shared options (beta != 0, asymmetric clip, Liger's default temperature), then what a type needs:
    dr_grpo's constant length, cispo's absolute IS-weight cap; then `overrides`."""
    options = {"loss_type": loss_type, "beta": 0.04, "epsilon_high": 0.28, "temperature": CASE.temperature}
    needs = {"dr_grpo": {"max_completion_length": CASE.T + 2}, "cispo": {"epsilon_high": 1.2}}
    options.update(needs.get(loss_type, {}))
    return gk.LossOptions(**{**options, **overrides})


LOSS_TYPE_LEVELS = [
    pytest.param(loss_type, level, id=f"{loss_type}-{level}")
    for loss_type in TRL_LOSS_TYPES  # the types Liger 0.8.5 implements too
    if loss_type != "luspo"
    for level in ("token", "sequence")
    if level == "token" or loss_type in CLIPPED
]


@pytest.mark.parametrize("loss_type, level", LOSS_TYPE_LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_types(backend, loss_type, level, launches):
    """Each shared loss type, with old_logp, ref_logp and beta != 0, and a fully masked sequence."""
    options = make_options(loss_type, importance_sampling_level=level)
    inputs = loss_inputs(CASE, F32, DEVICE)
    assert_matches_liger(*ours_and_liger(inputs, backend, options), options)
    assert launches[backend] > 0 and all(launches[other] == 0 for other in BACKENDS if other != backend)


OPTION_SETS = {  # name: (the options both sides share, the options under test)
    "two_sided_clip": (dict(loss_type="grpo"), dict(delta=1.3)),
    # a sequence ratio is a mean over tokens, so it stays near 1: narrow clip range, a delta just above it (Liger's
    # backward drops the gradient of a ratio in (delta, 1 + ε_high] with A < 0, which TRL's min() keeps)
    "two_sided_clip_sequence": (
        dict(loss_type="dapo", importance_sampling_level="sequence", epsilon_high=0.01),
        dict(delta=1.03),
    ),
    "bias_corrected_kl": (dict(loss_type="bnpo", use_bias_correction_kl=False), dict(use_bias_correction_kl=True)),
    "bias_corrected_kl_sequence": (
        dict(loss_type="grpo", importance_sampling_level="sequence", use_bias_correction_kl=False),
        dict(use_bias_correction_kl=True),
    ),
    "num_items_in_batch": (dict(loss_type="dapo"), dict(num_items_in_batch=23)),
    "sapo_temperatures": (dict(loss_type="sapo"), dict(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)),
    "vespo_gamma": (
        dict(loss_type="vespo"),
        dict(vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    ),
}


@pytest.mark.parametrize("option_set", OPTION_SETS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_options(backend, option_set):
    """Non-default options; each set must change the loss on these inputs, or the comparison would prove nothing."""
    shared, tested = OPTION_SETS[option_set]
    baseline = make_options(**shared)
    options = dataclasses.replace(baseline, **tested)
    inputs = loss_inputs(CASE, F32, DEVICE, seed=1)
    ours, peer = ours_and_liger(inputs, backend, options)
    assert_matches_liger(ours, peer, options)
    without = gk.grpo_loss(
        inputs["logits"],
        inputs["targets"],
        inputs["advantages"],
        inputs["old_logp"],
        inputs["ref_logp"],
        inputs["mask"],
        backend="torch",
        options=baseline,
    )
    assert not torch.allclose(ours[0], without.loss), f"{option_set} does not change the loss on these inputs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature(backend):
    """A temperature other than Liger's default 0.9 (old/ref log-probs drawn at that temperature)."""
    options = make_options("grpo", temperature=1.7)
    inputs = loss_inputs(dataclasses.replace(CASE, temperature=options.temperature), F32, DEVICE, seed=1)
    assert_matches_liger(*ours_and_liger(inputs, backend, options), options)


IS_RATIO_SETS = {
    "on_policy": dict(old_logp=None, ref_logp=None, beta=0.0),
    "is_ratio_per_token": dict(is_ratio=(CASE.B, CASE.T)),
    "is_ratio_per_sequence": dict(is_ratio=(CASE.B,)),
}


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("input_set", IS_RATIO_SETS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_and_is_ratio(backend, input_set, loss_type):
    """old_logp=None (ratio 1, gradient only) and the rollout importance weight, per token and per sequence."""
    spec = dict(IS_RATIO_SETS[input_set])
    inputs = loss_inputs(CASE, F32, DEVICE, seed=2)
    is_ratio = None
    if "is_ratio" in spec:
        g = torch.Generator().manual_seed(5)
        is_ratio = torch.exp(0.2 * torch.randn(spec.pop("is_ratio"), generator=g)).to(DEVICE)
        if is_ratio.dim() == 2:  # TRL's rollouts give exp(0) = 1 on padding, where vespo's sum reads it
            is_ratio = torch.where(inputs["mask"], is_ratio, torch.ones_like(is_ratio))
    inputs.update({k: spec.pop(k) for k in ("old_logp", "ref_logp") if k in spec})
    options = make_options(loss_type, **spec)
    assert_matches_liger(*ours_and_liger(inputs, backend, options, is_ratio), options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_luspo_without_padding(backend):
    """luspo at sequence level with every sequence T tokens long, where TRL, Liger and we agree."""
    options = make_options("luspo", importance_sampling_level="sequence")
    inputs = loss_inputs(CASE, F32, DEVICE)
    inputs["logits"] = inputs["logits"].nan_to_num()  # the rows the case masked (and poisoned) now count, as zeros
    inputs["mask"] = None
    assert_matches_liger(*ours_and_liger(inputs, backend, options), options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs(backend):
    """Liger's `fused_selective_log_softmax` (no gradient; masked tokens give 0) against our token_logprobs."""
    inputs = loss_inputs(CASE, F32, DEVICE)
    peer = fused_selective_log_softmax(
        liger_logits(inputs["logits"]), inputs["targets"], CASE.temperature, mask=inputs["mask"].int()
    )
    with torch.no_grad():
        ours = gk.token_logprobs(
            inputs["logits"], inputs["targets"], temperature=CASE.temperature, mask=inputs["mask"], backend=backend
        )
    assert_close(ours, peer, F32, "logp")

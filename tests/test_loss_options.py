"""The options beyond TRL against the float64 oracle: KL estimators, dual-clip, two-sided CISPO, entropy bonus,
verl's aggregation modes, token/sequence weights (and their gradients), per-sequence losses, packed input, and
extreme log-ratios. Every backend × dtype; loss, metrics and every gradient (Triton under its interpreter: the cells
`TRITON_CELLS` names)."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.options import CLIPPED_SURROGATE_TYPES, DPPO_TYPES, LOSS_AGG_MODES
from tests.cases import Case
from tests.conftest import BACKENDS, DEVICE, assert_close
from tests.helpers import (
    TRITON_INTERPRETED,
    backend_cells,
    interpreted_cells,
    kernel_forms_loss,
    loss_inputs,
    oracle_logits,
)

DTYPES = (torch.float32, torch.bfloat16)
CASE = Case("ragged_vocab")
TYPES = ("grpo", "dapo", "cispo", "sapo", "vespo", "gpg", "gspo_token", "gmpo", "tic_grpo", "clip_cov", "kl_cov")
# clip_cov cuts every candidate (ratio 1): its random draw cannot differ between our calls and the oracle's
TYPE_DEFAULTS = {"clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.0), "kl_cov": dict(kl_cov_ratio=0.25)}

OPTION_SETS = {
    "k1": dict(kl_estimator="k1"),
    "k2": dict(kl_estimator="k2", use_bias_correction_kl=True),
    "low_var_kl": dict(kl_estimator="low_var_kl"),
    "abs_kl": dict(kl_estimator="abs"),
    "dual_clip": dict(clip_ratio_c=1.1),  # below 1 + ε: the floor binds on many A < 0 tokens
    "cispo_two_sided": dict(cispo_two_sided=True, epsilon_high=0.28),
    "entropy_bonus": dict(entropy_coef=0.3),
    "entropy_bonus_top_quantile": dict(entropy_coef=0.3, top_entropy_quantile=0.5),
    **{f"agg_{mode}": dict(loss_agg_mode=mode) for mode in LOSS_AGG_MODES},
    "agg_counts": dict(loss_agg_mode="seq-mean-token-sum", num_sequences_in_batch=7.0),
    "agg_scale_factor": dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=11.0),
    "token_weights": dict(token_weights=True),
    "sequence_weights": dict(sequence_weights=True),
    "off_policy_mask": dict(off_policy_mask_threshold=0.0),  # against old_logp
    "off_policy_mask_sampler": dict(off_policy_mask_threshold=0.05, sampling_logp=True),
}
ONLY_FOR = {"dual_clip": CLIPPED_SURROGATE_TYPES, "cispo_two_sided": ("cispo",)}
TYPE_OPTIONS = [(t, o) for t in TYPES for o in OPTION_SETS if t in ONLY_FOR.get(o, TYPES)]
# DPPO's truncated IS weight (clip_ratio_c) inside a tight trust region, and DRO under verl's aggregations
OPTION_SETS["dppo_truncation"] = dict(clip_ratio_c=1.1, epsilon=0.005, epsilon_high=0.0075)  # masks and caps
OPTION_SETS["dro_seq_mean"] = dict(dro_beta=0.3, loss_agg_mode="seq-mean-token-mean")
TYPE_OPTIONS += [(t, "dppo_truncation") for t in DPPO_TYPES] + [("dro", "dro_seq_mean")]
WEIGHT_FLAGS = ("token_weights", "sequence_weights", "sampling_logp")  # run_both's inputs, not LossOptions


def cell_options(loss_type: str, option_set: str) -> dict:
    return dict(OPTION_SETS[option_set], loss_type=loss_type, beta=0.04, **TYPE_DEFAULTS.get(loss_type, {}))


def fused(backend: str, options: dict) -> bool:
    """Whether run_both's second call forms the loss in the backend's kernel epilogue (its weights take gradients:
    never)."""
    if options.get("token_weights") or options.get("sequence_weights"):
        return False
    return kernel_forms_loss(backend, **{k: v for k, v in options.items() if k not in WEIGHT_FLAGS})


# Under the interpreter Triton runs `interpreted_cells`: the fused-epilogue cells, each loss type and option set once
TRITON_CELLS = interpreted_cells(TYPE_OPTIONS, lambda t, o: fused("triton", cell_options(t, o)))
CELLS = backend_cells(BACKENDS, TYPE_OPTIONS, lambda: TRITON_CELLS)


def _weights(shape, seed: int, requires_grad: bool) -> torch.Tensor:
    w = 0.5 + torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return w.to(DEVICE, torch.float32).requires_grad_(requires_grad)


def run_both(inputs: dict, backend: str, weights_grad: bool = True, sequence_losses: bool = True, **options):
    """Our grpo_loss and the oracle on the same inputs: loss, metrics, sequence losses (from a second, two-phase
    call; None without `sequence_losses`) and every gradient."""
    B, T = inputs["mask"].shape
    weights = {}
    if options.pop("token_weights", False):
        weights["token_weights"] = _weights((B, T), 1, weights_grad)
    if options.pop("sequence_weights", False):
        weights["sequence_weights"] = _weights((B,), 2, weights_grad)
    if options.pop("sampling_logp", False):  # the sampler's log-probs: old_logp shifted by a per-token drift
        drift = 0.3 * torch.randn((B, T), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        weights["sampling_logp"] = (inputs["old_logp"].detach().double().cpu() + drift).to(DEVICE, torch.float32)
    args = {k: inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")}
    ref_logits = oracle_logits(inputs["logits"])
    ref_weights = {k: v.detach().double().cpu().requires_grad_(k != "sampling_logp") for k, v in weights.items()}
    seq = None
    if sequence_losses:
        seq = gk.grpo_loss(
            inputs["logits"], **args, **weights, backend=backend, inplace=False, return_sequence_losses=True, **options
        )[1]  # the two-phase path: it has the shares
    logits = inputs["logits"].detach().requires_grad_()
    out = gk.grpo_loss(logits, **args, **weights, backend=backend, with_entropy=True, **options)  # fused if it can
    out.loss.backward()
    cpu = {k: v.cpu() for k, v in args.items()}
    ref_loss, ref_metrics, ref_seq = reference.grpo_loss(
        ref_logits, **cpu, **ref_weights, return_sequence_losses=True, **options
    )
    ref_loss.backward()
    grads = {"logits": (logits.grad, ref_logits.grad)}
    grads.update({k: (weights[k].grad, ref_weights[k].grad) for k in weights if weights_grad and k != "sampling_logp"})
    return (out, seq), (ref_loss, ref_metrics, ref_seq), grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend,loss_type,option_set", CELLS)
def test_option_matches_reference(backend, dtype, loss_type, option_set, launches):
    options = cell_options(loss_type, option_set)
    expect_fused = fused(backend, options)
    # The per-sequence losses come from a second call, always two-phase: on an interpreted Triton cell whose loss the
    # kernel forms that call is a two-phase cell again (Triton's plain pass, then the backend-independent algebra
    # the torch cell checks), which the two-phase cells of TRITON_CELLS cover
    sequence_losses = not (backend == "triton" and TRITON_INTERPRETED and expect_fused)
    inputs = loss_inputs(CASE, dtype, DEVICE, seed=5)
    (out, seq), (ref_loss, ref_metrics, ref_seq), grads = run_both(
        inputs, backend, sequence_losses=sequence_losses, **options
    )
    assert launches["fused_epilogue"] == int(expect_fused), "the route is not the one the cells were chosen by"
    assert_close(out.loss, ref_loss, dtype, "loss")
    if sequence_losses:
        assert_close(seq, ref_seq, dtype, "sequence losses")
    for name, (ours, expected) in grads.items():
        assert ours is not None, f"no gradient for {name}"
        assert_close(ours, expected, dtype, f"grad {name}")
    for name, value in out.metrics.items():
        assert_close(value, ref_metrics[name], dtype, name)
    if options.get("clip_ratio_c"):
        assert ("clip_ratio/truncated_mean" if loss_type in DPPO_TYPES else "clip_ratio/dual_mean") in out.metrics


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixed_weights_stay_on_the_fused_path(backend, launches):
    """Weights that need no gradient fold into the epilogue's per-token weight (Triton: one fused pass)."""
    inputs = loss_inputs(CASE, torch.float32, DEVICE, seed=5)
    (out, _), (ref_loss, _, _), grads = run_both(
        inputs, backend, weights_grad=False, loss_type="dapo", token_weights=True, sequence_weights=True, beta=0.04
    )
    assert_close(out.loss, ref_loss, torch.float32, "loss")
    assert_close(*grads["logits"], torch.float32, "grad logits")


@pytest.mark.parametrize("loss_type", ["grpo", "gspo_token", "tic_grpo", "gmpo", "vespo"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend, loss_type):
    """The same tokens packed with cu_seqlens (padding never enters the vocabulary pass) give the same loss,
    metrics and logits gradient as the padded layout; sequence-level variants reduce per segment."""
    inputs = loss_inputs(Case("masked_row", B=4, T=6), torch.float32, DEVICE, seed=9)
    lengths = torch.tensor([6, 2, 4, 3])
    present = torch.arange(6)[None] < lengths[:, None]  # [B, T] the tokens that exist
    mask = inputs["mask"] & present.to(DEVICE)
    inputs["logits"][~mask] = 0.0
    options = dict(loss_type=loss_type, beta=0.04, entropy_coef=0.1)
    padded = inputs["logits"].detach().clone().requires_grad_()
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp")]
    out = gk.grpo_loss(padded, *args, mask, backend=backend, **options)
    out.loss.backward()
    packed = inputs["logits"][present].detach().clone().requires_grad_()
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).to(DEVICE)
    targets, advantages, old, ref = args
    out_packed = gk.grpo_loss(
        packed,
        targets[present],
        advantages,
        old[present],
        ref[present],
        mask[present],
        cu_seqlens=cu_seqlens,
        backend=backend,
        **options,
    )
    out_packed.loss.backward()
    assert_close(out_packed.loss, out.loss, torch.float32, "loss")
    assert_close(packed.grad, padded.grad[present], torch.float32, "grad logits")
    assert set(out_packed.metrics) == set(out.metrics)
    for name, value in out.metrics.items():
        assert_close(out_packed.metrics[name], value, torch.float32, name)


@pytest.mark.parametrize("loss_type", TYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_log_ratios_stay_finite(backend, loss_type):
    """|logp − old| and |ref − logp| up to 100: values, metrics and gradients stay finite (the ±20 clamps)."""
    inputs = loss_inputs(CASE, torch.float32, DEVICE, seed=13)
    g = torch.Generator().manual_seed(13)
    sign = torch.where(torch.rand(CASE.B, CASE.T, generator=g) > 0.5, 1.0, -1.0).to(DEVICE)
    inputs["old_logp"] = inputs["old_logp"] + 100.0 * sign
    inputs["ref_logp"] = inputs["ref_logp"] - 100.0 * sign
    logits = inputs["logits"].detach().requires_grad_()
    args = [inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")]
    out = gk.grpo_loss(logits, *args, loss_type=loss_type, beta=0.04, use_bias_correction_kl=True, backend=backend)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(v) for v in out.metrics.values()), out.metrics
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_off_policy_mask_is_trls(per_token_advantages):
    """The off-policy sequence mask equals TRL's own `GRPOTrainer.get_off_policy_mask`, NaN sampler tokens included,
    and it drops at least one sequence (else the comparison would prove nothing)."""
    trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from grpo_kernels.losses.loss import off_policy_keep
    from grpo_kernels.losses.terms import build_terms
    from grpo_kernels.options import LossOptions

    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampling = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling[0, 1] = float("nan")
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn((B, T) if per_token_advantages else (B,), generator=g, dtype=torch.float64)
    options = LossOptions(off_policy_mask_threshold=0.05)
    terms = build_terms(logp, advantages=adv, mask=mask, options=options, sampling_logp=sampling)
    ours = off_policy_keep(terms, options)
    adv_trl = adv if per_token_advantages else adv[:, None]
    theirs = trl_trainer.GRPOTrainer.get_off_policy_mask(adv_trl, logp, sampling, mask.double(), 0.05)
    kept = mask if per_token_advantages else torch.ones(B, 1, dtype=torch.bool)  # padding's value is never used
    assert torch.equal(ours * kept, theirs.to(ours.dtype) * kept)
    assert (ours[kept.expand_as(ours)] == 0).any() and (ours == 1).any()

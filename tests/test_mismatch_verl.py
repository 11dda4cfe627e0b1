"""The rollout correction against verl 0.9.1's own `rollout_corr_helper` on the same tensors: IS weights at both
levels under TIS and IcePop bounds, with and without batch normalisation; every rejection statistic alone and
combined; the metrics under verl's names; both bypass losses (PPO-clip and REINFORCE) through `grpo_loss` against
verl's `compute_policy_loss_bypass_mode`, and the decoupled loss against verl's vanilla loss on the weights and
mask verl's helper forms. Hard cases: every token rejected, empty sequences, −inf sampler log-probs, garbage at
padding. float64 to 1e-12, float32 to 1e-6."""

import pytest
import torch

helper = pytest.importorskip(
    "verl.trainer.ppo.rollout_corr_helper", reason='verl is not installed: pip install "grpo-kernels[verl]"'
)

from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.integrations.verl import options_from_config  # noqa: E402
from grpo_kernels.losses.mismatch import rollout_correction  # noqa: E402
from grpo_kernels.rollout_correction import RS_STATISTICS, VERL_PRESETS, RolloutCorrection, preset  # noqa: E402
from tests.test_verl import actor_config  # noqa: E402

B, T, V = 6, 9, 17
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
THRESHOLDS = {"k1": "0.7_1.4", "k2": 0.08, "k3": 0.08}  # each statistic's bounds: about a third rejected
SEQ_THRESHOLDS = {"seq_sum_k1": "0.5_2.0", "seq_sum_k2": 0.6, "seq_sum_k3": 0.6, "seq_max_k2": 0.25, "seq_max_k3": 0.25}


def inputs(seed: int, dtype: torch.dtype, spread: float = 0.3) -> dict:
    """Ragged rows (one empty), garbage (−inf, NaN) at padding, as a sampler and a trainer hand them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 0, 7, 1, 6])
    mask = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    old = -(2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)) - 0.1  # [B, T]
    sampling = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    sampling = sampling.masked_fill(~mask, -float("inf"))
    old = old.masked_fill(~mask, float("nan"))
    return dict(old=old.to(dtype), sampling=sampling.to(dtype), mask=mask)


def verl_correction(x: dict, **config):
    """verl's weights (None when off), rejected mask and metrics."""
    weights, mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=x["old"], rollout_log_prob=x["sampling"], response_mask=x["mask"].to(x["old"].dtype), **config
    )
    return (None if weights is None else weights.batch["rollout_is_weights"]), mask, metrics


def assert_same(x: dict, ours, theirs, dtype) -> None:
    """Weights and the rejected mask at the kept tokens, and every metric verl reports that we report (our set must
    hold verl's IS and off-policy metrics whole, and each statistic's mean, extremes and rejected fractions)."""
    weights, mask, metrics = theirs
    keep = x["mask"]
    tol = TOL[dtype]
    if weights is None:
        assert ours.weights is None
    else:
        torch.testing.assert_close(ours.weights[keep], weights[keep], rtol=tol, atol=tol)
    rejected = keep if ours.keep is None else keep & ours.keep
    torch.testing.assert_close(rejected.to(mask.dtype), mask)
    ours_metrics = {name: value.item() for name, value in ours.metrics.items()}
    required = [n for n in metrics if not n.startswith("rollout_corr/rollout_rs_") or _rs_summary(n)]
    missing = [n for n in required if n not in ours_metrics]
    assert not missing, missing
    for name, value in metrics.items():
        if name in ours_metrics:
            mine = torch.tensor(ours_metrics[name], dtype=torch.float64)
            torch.testing.assert_close(mine, torch.tensor(value, dtype=torch.float64), rtol=tol, atol=tol, msg=name)


def _rs_summary(name: str) -> bool:
    """A rejection metric we report: each statistic's mean, max, min, masked fractions, and the overall ones."""
    suffixes = ("_mean", "_max", "_min", "_masked_fraction")
    return name.endswith(suffixes) and not name.endswith(("_seq_mean", "_seq_max", "_seq_min"))


def both(x: dict, dtype, correction: RolloutCorrection, **config) -> None:
    ours = rollout_correction(x["old"], x["sampling"], x["mask"], correction)
    assert_same(x, ours, verl_correction(x, **config), dtype)


DTYPES = pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("f64", "f32"))


@DTYPES
@pytest.mark.parametrize("threshold", (2.0, 1.2, "0.5_1.5", "0.9_5.0"), ids=("tis2", "tis1.2", "icepop", "icepop_hi"))
@pytest.mark.parametrize("level", ("token", "sequence"))
def test_importance_weights(level, threshold, dtype):
    """Raw and batch-normalised weights on the same inputs."""
    x = inputs(0, dtype)
    for normalize in (False, True):
        fields = dict(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
        both(x, dtype, RolloutCorrection(**fields), **fields)


def _threshold(statistic: str):
    return SEQ_THRESHOLDS.get(statistic, THRESHOLDS[statistic[-2:]])


@DTYPES
@pytest.mark.parametrize("statistic", RS_STATISTICS)
def test_each_rejection_statistic(statistic, dtype):
    x = inputs(1, dtype)
    fields = dict(rollout_rs=statistic, rollout_rs_threshold=_threshold(statistic))
    ours = rollout_correction(x["old"], x["sampling"], x["mask"], RolloutCorrection(**fields))
    assert_same(x, ours, verl_correction(x, **fields), dtype)
    rejected = ~ours.keep & x["mask"]
    assert 0 < rejected.sum() < x["mask"].sum()  # the case rejects some tokens, not all


@DTYPES
@pytest.mark.parametrize(
    "statistics",
    (
        "token_k1,seq_sum_k2,seq_max_k3",
        "seq_mean_k1,seq_mean_k3,token_k2,seq_mean_k1",  # a duplicate is dropped, as in verl
        "seq_max_k2,token_k3,seq_sum_k1,seq_mean_k2",
    ),
)
@pytest.mark.parametrize("shared", (False, True), ids=("per_statistic", "one_threshold"))
def test_rejection_combined(statistics, shared, dtype):
    names = list(dict.fromkeys(statistics.split(",")))
    # one threshold for all: 3.0 is k1's ratio bounds [1/3, 3] (verl's reciprocal) and k2's / k3's upper bound
    threshold = 3.0 if shared else ",".join(str(_threshold(n)) for n in names)
    fields = dict(rollout_rs=statistics, rollout_rs_threshold=threshold, rollout_is="sequence")
    both(inputs(2, dtype, spread=0.2), dtype, RolloutCorrection(**fields), **fields)


@DTYPES
def test_every_token_rejected(dtype):
    x = inputs(3, dtype)
    fields = dict(rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="1e-9,0.999999_1.000001", rollout_is="token")
    ours = rollout_correction(x["old"], x["sampling"], x["mask"], RolloutCorrection(**fields))
    assert not (ours.keep & x["mask"]).any()
    assert_same(x, ours, verl_correction(x, **fields), dtype)


@DTYPES
def test_negative_infinite_sampler_logp(dtype):
    """A sampler log-prob of −inf at a kept token: verl clamps the log-ratio at ±20; so do we (some metrics are
    inf or NaN in both, equally)."""
    x = inputs(4, dtype)
    x["sampling"][0, 3] = -float("inf")
    for fields in (
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_max_k3", rollout_rs_threshold=0.5),
        dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_rs="token_k1", rollout_rs_threshold=2.0),
    ):
        ours = rollout_correction(x["old"], x["sampling"], x["mask"], RolloutCorrection(**fields))
        weights, mask, metrics = verl_correction(x, **fields)
        keep = x["mask"]
        torch.testing.assert_close(ours.weights[keep], weights[keep], rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close((keep & ours.keep).to(mask.dtype), mask)
        for name, value in metrics.items():
            if name in ours.metrics:
                expected = torch.tensor(value, dtype=torch.float64)
                mine = ours.metrics[name].double()
                torch.testing.assert_close(mine, expected, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True, msg=name)


def logits_case(seed: int, dtype, spread: float = 0.15):
    """Logits and the log-probs verl sees (one graph), and the rollout's log-probs near them."""
    g = torch.Generator().manual_seed(seed)
    x = inputs(seed, dtype, spread=0.0)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    log_prob = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]  # [B, T]
    sampling = log_prob.detach() + spread * torch.randn(B, T, generator=g, dtype=dtype)  # [B, T]
    advantages = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T)
    return logits, targets, log_prob, sampling, advantages, x["mask"]


# The presets' losses: every preset in float64; in float32 a subset holding each IS level and bound, each
# rejection kind and both bypass losses (the float32 weights and masks of every mode are the tests above).
FLOAT32_PRESETS = (
    "decoupled_token_icepop",
    "decoupled_seq_is_rs",
    "decoupled_k3_rs_token_tis",
    "bypass_ppo_clip_geo_rs",
    "bypass_pg_is",
    "bypass_pg_token_icepop",
)


def preset_cases(bypass: bool) -> list:
    """(preset name, dtype) of the bypass or the decoupled presets."""
    names = [n for n, (_, loss) in VERL_PRESETS.items() if (loss is not None) == bypass]
    cases = [pytest.param(n, torch.float64, id=f"{n}-f64") for n in names]
    return cases + [pytest.param(n, torch.float32, id=f"{n}-f32") for n in names if n in FLOAT32_PRESETS]


@pytest.mark.parametrize("name, dtype", preset_cases(bypass=True))
def test_bypass_losses_equal_verls(name, dtype):
    """Every bypass preset (PPO-clip and REINFORCE): verl's bypass loss against `grpo_loss` with the preset, loss
    and gradient w.r.t. the logits."""
    logits, targets, log_prob, sampling, advantages, mask = logits_case(5, dtype, _spread(name))
    config = actor_config("token-mean", policy_loss=dict(rollout_correction=getattr(RolloutCorrectionConfig, name)()))
    theirs, _ = core_algos.compute_policy_loss_bypass_mode(
        old_log_prob=sampling, log_prob=log_prob, advantages=advantages, response_mask=mask.to(dtype),
        loss_agg_mode="token-mean", config=config,
    )  # fmt: skip
    assert_same_loss(theirs, name, config, (logits, targets, advantages, None, mask, sampling), dtype)


@pytest.mark.parametrize("name, dtype", preset_cases(bypass=False))
def test_decoupled_losses_equal_verls(name, dtype):
    """Every decoupled preset: verl's helper forms the weights and the rejected mask, verl's vanilla loss takes
    them; `grpo_loss` with the preset forms them itself. Loss and gradient w.r.t. the logits."""
    logits, targets, log_prob, sampling, advantages, mask = logits_case(6, dtype, _spread(name))
    g = torch.Generator().manual_seed(7)
    old = log_prob.detach() + 0.05 * torch.randn(B, T, dtype=dtype, generator=g)  # [B, T]
    sampling = old + _spread(name) * torch.randn(B, T, dtype=dtype, generator=g)  # [B, T]
    fields, _ = VERL_PRESETS[name]
    config = actor_config("token-mean")
    weights, verl_mask, _ = verl_correction(dict(old=old, sampling=sampling, mask=mask), **_verl_fields(fields))
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old, log_prob=log_prob, advantages=advantages, response_mask=verl_mask,
        loss_agg_mode="token-mean", config=config, rollout_is_weights=weights,
    )  # fmt: skip
    assert_same_loss(theirs, name, config, (logits, targets, advantages, old, mask, sampling), dtype)


def assert_same_loss(theirs, name: str, config, tensors: tuple, dtype) -> None:
    """`grpo_loss` with preset `name` on verl's config (dapo, or gpg for verl's REINFORCE) equals verl's loss
    `theirs`: the loss and its gradient w.r.t. the logits."""
    logits, targets, advantages, old, mask, sampling = tensors
    correction, loss_type = preset(name)
    options, _ = options_from_config(loss_type or "dapo", config, "token-mean", mask, {})
    ours = gk.grpo_loss(
        logits, targets, advantages[:, 0], old, None, mask, sampling_logp=sampling, inplace=False,
        options=type(options)(**{**_fields(options), "rollout_correction": correction}),
    )  # fmt: skip
    tol = TOL[dtype]
    torch.testing.assert_close(ours.loss, theirs, rtol=tol, atol=tol)
    grad_ours, grad_theirs = (torch.autograd.grad(loss, logits)[0] for loss in (ours.loss, theirs))
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=tol, atol=tol)


def _spread(name: str) -> float:
    """The sampler's log-prob noise of a preset's case: geo-RS keeps sequences within ±0.1% of ratio 1."""
    return 3e-4 if "geo_rs" in name else 0.15


def _verl_fields(fields: dict) -> dict:
    """A preset's fields as `compute_rollout_correction_and_rejection_mask` takes them (rollout_is None: off)."""
    return {"rollout_is": None, **{k: v for k, v in fields.items() if k != "bypass_mode"}}


def _fields(options) -> dict:
    return {name: getattr(options, name) for name in options.__dataclass_fields__}


def test_presets_are_verls():
    """Each named preset holds the fields of verl's factory method of the same name (at its defaults)."""
    for name, (fields, verl_loss) in VERL_PRESETS.items():
        verl_config = getattr(RolloutCorrectionConfig, name)()
        for field in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode"):
            default = {"rollout_is": None, "rollout_is_threshold": 2.0, "bypass_mode": False}.get(field)
            assert str(fields.get(field, default)) == str(getattr(verl_config, field)), (name, field)
        assert (verl_loss or "ppo_clip") == verl_config.loss_type or not verl_config.bypass_mode, name


@DTYPES
@pytest.mark.parametrize("name, loss_type", (("bypass_ppo_clip_k3_rs", "dapo"), ("bypass_pg_geo_rs_seq_tis", "gpg")))
def test_registered_loss_takes_verls_rollout_correction(name, loss_type, dtype):
    """A gk_ policy loss under verl's bypass rollout_correction equals verl's bypass_mode loss: loss, gradient
    w.r.t. log_prob, and the rollout_corr/ metrics."""
    from grpo_kernels.integrations import verl as gk_verl

    _, _, log_prob, sampling, advantages, mask = logits_case(9, dtype, _spread(name))
    config = actor_config("token-mean", policy_loss=dict(rollout_correction=getattr(RolloutCorrectionConfig, name)()))
    arguments = dict(advantages=advantages, response_mask=mask.to(dtype), loss_agg_mode="token-mean", config=config)
    theirs, their_metrics = core_algos.compute_policy_loss_bypass_mode(sampling, log_prob, **arguments)
    ours, our_metrics = gk_verl.policy_loss_fn(loss_type)(sampling, log_prob, **arguments)
    tol = TOL[dtype]
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    grads = [torch.autograd.grad(loss, log_prob, retain_graph=True)[0] for loss in (ours, theirs)]
    torch.testing.assert_close(*grads, rtol=tol, atol=tol)
    shared = [n for n in their_metrics if n.startswith("rollout_corr/") and n in our_metrics]
    assert "rollout_corr/rollout_rs_masked_fraction" in shared and "rollout_corr/chi2_token" in shared
    for n in shared:
        assert our_metrics[n] == pytest.approx(their_metrics[n], rel=tol, abs=tol, nan_ok=True), n


NORMALISER_CASES = {  # name -> the correction's fields
    "decoupled_rs": dict(rollout_is="token", rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.05,0.6_1.6"),
    "bypass_rs": dict(rollout_rs="seq_max_k2", rollout_rs_threshold=0.02, bypass_mode=True),
    "every_token_rejected": dict(rollout_rs="token_k2", rollout_rs_threshold=1e-12),
}


@pytest.mark.parametrize("name", NORMALISER_CASES)
def test_trainer_normaliser_is_verls(name):
    """The trainer's step normaliser over two micro-batches against verl's own path: decoupled, verl's helper drops
    the rejected tokens from the response mask before the update, so `batch_num_tokens` (the count verl's engine
    all-reduces) leaves them out; under bypass the rejection happens inside verl's loss, after that count. A step
    whose every token is rejected: 0 here, verl's 0 / 0 = NaN."""
    from grpo_kernels.trainer.policy import UpdateBatch
    from grpo_kernels.trainer.update import step_normalisers

    dtype = torch.float64
    logits, targets, log_prob, sampling, advantages, mask = logits_case(10, dtype)
    fields = NORMALISER_CASES[name]
    correction = RolloutCorrection(**fields)
    noise = 0.3 * torch.randn(B, T, dtype=dtype, generator=torch.Generator().manual_seed(11))  # [B, T]
    old = None if correction.bypass_mode else log_prob.detach() + noise
    verl_old = log_prob.detach() if correction.bypass_mode else old  # bypass: π_θ against the sampler
    verl_config = {k: v for k, v in fields.items() if k != "bypass_mode"} | {"rollout_is": fields.get("rollout_is")}
    weights, verl_mask, _ = verl_correction(dict(old=verl_old, sampling=sampling, mask=mask), **verl_config)
    counted = mask if correction.bypass_mode else verl_mask  # verl's loss_mask when its engine counts the tokens
    batch_info = dict(dp_size=1, batch_num_tokens=counted.sum().item(), global_batch_size=B)
    arguments = dict(advantages=advantages, response_mask=mask.to(dtype), loss_agg_mode="token-mean")
    if correction.bypass_mode:
        policy_loss = dict(rollout_correction=RolloutCorrectionConfig(**fields))
        config = actor_config("token-mean", policy_loss=policy_loss, batch_info=batch_info)
        theirs, _ = core_algos.compute_policy_loss_bypass_mode(sampling, log_prob, config=config, **arguments)
    else:
        config = actor_config("token-mean", batch_info=batch_info)
        arguments["response_mask"] = verl_mask
        theirs, _ = core_algos.compute_policy_loss_vanilla(
            old, log_prob, config=config, rollout_is_weights=weights, **arguments
        )

    options, _ = options_from_config("dapo", actor_config("token-mean"), "token-mean", mask, {})
    options = type(options)(**{**_fields(options), "rollout_correction": correction})
    tokens = torch.zeros(B, T + 1, dtype=torch.long)
    whole = UpdateBatch(
        input_ids=tokens, attention_mask=torch.ones_like(tokens), completion_mask=mask, advantages=advantages[:, 0],
        old_logp=sampling if old is None else old, sampling_logp=sampling,
    )  # fmt: skip
    micro_batches = [whole.rows(rows) for rows in torch.tensor_split(torch.arange(B), 2)]
    step_options, scales, _ = step_normalisers(options, micro_batches)
    ours = sum(
        scale * gk.grpo_loss(
            logits[micro_rows], targets[micro_rows], micro.advantages, None if old is None else micro.old_logp, None,
            micro.completion_mask, sampling_logp=micro.sampling_logp, inplace=False, options=step_options,
        ).loss
        for micro, micro_rows, scale in zip(micro_batches, torch.tensor_split(torch.arange(B), 2), scales, strict=True)
    )  # fmt: skip
    (grad_ours,) = torch.autograd.grad(ours, logits)
    if name == "every_token_rejected":
        assert torch.isnan(theirs) and ours.item() == 0.0 and not grad_ours.any()
        return
    assert 0 < verl_mask.sum() < mask.sum()  # the case rejects some tokens
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    (grad_theirs,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-12, atol=1e-12)

"""The rollout correction in the loss: TRL's four modes are points of it (the trainer's weights, the same loss);
NeMo RL's tis / icepop / seq-mask-tis and prime-rl's IPO equal their float64 transcriptions (`reference_mismatch`);
packed equals padded, the fused lm_head equals logits; no host read and no graph break with check_finite=False;
bad options and inputs are one error naming the option before any kernel runs. verl's own code: test_mismatch_verl."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference_mismatch as ref
from grpo_kernels.engine import routes
from grpo_kernels.losses.mismatch import rollout_correction
from grpo_kernels.rollout_correction import TRL_MODES, RolloutCorrection
from grpo_kernels.trainer.sampler_correction import importance_sampling_ratio
from tests.test_host_syncs import HostReads
from tests.test_torch_compile import _graph_breaks_against_eager

B, T, V, H = 5, 8, 23, 12
F64 = torch.float64
HEAVY = RolloutCorrection(  # sequence rejection + IcePop + batch normalisation (+ every metric, always)
    rollout_is="token",
    rollout_is_threshold="0.5_2.0",
    rollout_is_batch_normalize=True,
    rollout_rs="seq_mean_k3,seq_max_k2,token_k1",
    rollout_rs_threshold="0.05,0.3,0.4_2.5",
)


def case(seed: int = 0, dtype=F64, spread: float = 0.2) -> dict:
    """Ragged rows (one empty), the policy's logits and log-probs, π_old and the sampler's log-probs near them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 3, 0, 6, 5])
    mask = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    logits = torch.randn(B, T, V, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]  # [B, T]
    old = logp + 0.05 * torch.randn(B, T, generator=g, dtype=dtype)  # [B, T]
    sampling = old + spread * torch.randn(B, T, generator=g, dtype=dtype)  # [B, T]
    advantages = torch.randn(B, generator=g, dtype=dtype)
    return dict(logits=logits, targets=targets, logp=logp, old=old, sampling=sampling, adv=advantages, mask=mask)


def loss_and_grad(x: dict, old=None, **keywords):
    logits = x["logits"].clone().requires_grad_()
    out = gk.grpo_loss(logits, x["targets"], x["adv"], old, None, x["mask"], inplace=False, **keywords)
    return out, torch.autograd.grad(out.loss, logits)[0]


@pytest.mark.parametrize("clip", ((None, 3.0), (0.5, 2.0), (0.8, None)), ids=("max", "min_max", "min"))
@pytest.mark.parametrize("mode", TRL_MODES)
def test_trl_modes_are_points(mode, clip):
    """TRL's vllm_importance_sampling modes: the record's weights are the trainer's `importance_sampling_ratio`,
    and the loss with the record is the loss with that ratio as is_ratio."""
    x = case(1)
    clip_min, clip_max = clip
    correction = RolloutCorrection.from_trl(mode, clip_min, clip_max)
    ratio = importance_sampling_ratio(x["old"], x["sampling"], x["mask"].double(), mode, clip_min, clip_max)
    weights = rollout_correction(x["old"], x["sampling"], x["mask"], correction).weights
    expected = ratio if ratio.dim() == 2 else ratio[:, None].expand(B, T)
    keep = x["mask"]
    torch.testing.assert_close(weights[keep], expected[keep], rtol=1e-12, atol=1e-12)
    ours, grad = loss_and_grad(x, x["old"], sampling_logp=x["sampling"], rollout_correction=correction)
    theirs, grad_theirs = loss_and_grad(x, x["old"], is_ratio=ratio)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_theirs, rtol=1e-12, atol=1e-12)


NEMO_POINTS = {  # NeMo's (truncated_importance_sampling_type, ratio, ratio_min, sequence level) -> the record
    "tis": (("tis", 1.3, None, False), dict(rollout_is="token", rollout_is_threshold=1.3)),
    "tis_min": (
        ("tis", 1.3, 0.9, False),
        dict(rollout_is="token", rollout_is_threshold=1.3, rollout_is_threshold_lower=0.9),
    ),
    "icepop": (("icepop", 1.3, 0.8, False), dict(rollout_is="token", rollout_is_threshold="0.8_1.3")),
    "seq_tis": (("tis", 1.5, None, True), dict(rollout_is="sequence", rollout_is_threshold=1.5)),
    "seq_mask_tis": (
        ("seq-mask-tis", 1.01, 0.99, False),
        dict(rollout_is="token", rollout_is_threshold=None, geo_mask="0.99_1.01"),
    ),
}


@pytest.mark.parametrize("name", NEMO_POINTS)
def test_nemo_rl_points(name):
    """NeMo RL's IS corrections: the same weights, the same token-level clipped loss and gradient, and NeMo's
    four mismatch metrics."""
    x = case(2, spread=0.1 if name != "seq_mask_tis" else 0.03)
    (kind, ratio, ratio_min, sequence), fields = NEMO_POINTS[name]
    mask = x["mask"].double()
    nemo_weights = ref.nemo_importance_weights(x["old"], x["sampling"], mask, kind, ratio, ratio_min, sequence)
    correction = RolloutCorrection(**fields)
    ours = rollout_correction(x["old"], x["sampling"], x["mask"], correction)
    keep = x["mask"]
    torch.testing.assert_close(ours.weights[keep], nemo_weights[keep], rtol=1e-12, atol=1e-12)
    if name == "seq_mask_tis":
        assert 0 < (nemo_weights[keep] == 0).sum() < keep.sum()  # the mask drops some sequences, not all
    logits = x["logits"].clone().requires_grad_()
    logp = torch.log_softmax(logits, -1).gather(-1, x["targets"][..., None])[..., 0]
    expected = ref.nemo_token_loss(logp, x["old"], x["adv"][:, None], mask, nemo_weights, 0.2)
    out = gk.grpo_loss(
        logits,
        x["targets"],
        x["adv"],
        x["old"],
        None,
        x["mask"],
        inplace=False,
        loss_type="dapo",
        sampling_logp=x["sampling"],
        rollout_correction=correction,
        num_items_in_batch=float(mask.sum()) + 1e-8,
    )  # fmt: skip  (NeMo's masked mean divides by count + 1e-8)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(loss, logits, retain_graph=True)[0] for loss in (out.loss, expected)]
    torch.testing.assert_close(*grads, rtol=1e-12, atol=1e-12)
    for metric, value in ref.nemo_mismatch_metrics(x["old"], x["sampling"], mask).items():
        torch.testing.assert_close(out.metrics[f"rollout_corr/{metric}"], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threshold", (0.005, 0.02))
def test_prime_rl_ipo(threshold):
    """prime-rl's IPO (bypass: the trainer against the sampler): the policy term dropped where |p_θ − p_μ| > ε and
    τ·(log r)² on every token; the same gradient as prime-rl's loss (its −A·r and our −A·sg(r)·logp differ by a
    value of no gradient) and its is_masked fraction."""
    x = case(3, spread=0.3)
    tau = 0.05
    correction = RolloutCorrection(
        bypass_mode=True, rollout_is="token", rollout_is_threshold=None, ipo_threshold=threshold, log_ratio_penalty=tau
    )
    logits = x["logits"].clone().requires_grad_()
    logp = torch.log_softmax(logits, -1).gather(-1, x["targets"][..., None])[..., 0]
    expected, is_masked = ref.prime_ipo_loss(logp, x["sampling"], x["adv"][:, None], x["mask"], threshold, tau)
    out = gk.grpo_loss(
        logits, x["targets"], x["adv"], None, None, x["mask"], inplace=False, loss_type="gpg",
        sampling_logp=x["sampling"], rollout_correction=correction,
    )  # fmt: skip
    grads = [torch.autograd.grad(loss, logits, retain_graph=True)[0] for loss in (out.loss, expected)]
    torch.testing.assert_close(*grads, rtol=1e-12, atol=1e-12)
    assert 0 < is_masked < 1
    torch.testing.assert_close(out.metrics["rollout_corr/ipo_masked_fraction"], is_masked, rtol=1e-7, atol=0)


def _packed(x: dict) -> dict:
    mask = x["mask"]
    lengths = mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    return dict(
        logits=x["logits"][mask], targets=x["targets"][mask], old=x["old"][mask], sampling=x["sampling"][mask], cu=cu
    )


@pytest.mark.parametrize(
    "correction, loss_type",
    ((HEAVY, "dapo"), (RolloutCorrection(bypass_mode=True, rollout_rs="seq_max_k3", rollout_rs_threshold=0.2), "grpo")),
    ids=("decoupled", "bypass"),
)
def test_packed_and_fused_lm_head(correction, loss_type):
    """Packed (cu_seqlens) and the fused lm_head (3-GEMM route when decoupled) give the padded logits' loss, metrics
    and gradients."""
    x = case(4)
    old = None if correction.bypass_mode else x["old"]
    keywords = dict(sampling_logp=x["sampling"], rollout_correction=correction, loss_type=loss_type)
    padded, grad = loss_and_grad(x, old, **keywords)
    p = _packed(x)
    logits = p["logits"].clone().requires_grad_()
    packed = gk.grpo_loss(
        logits, p["targets"], x["adv"], None if old is None else p["old"], cu_seqlens=p["cu"], inplace=False,
        sampling_logp=p["sampling"], rollout_correction=correction, loss_type=loss_type,
    )  # fmt: skip
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(packed.loss, logits)[0], grad[x["mask"]], rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, T, H, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    fused = gk.fused_linear_grpo_loss(hidden, weight, x["targets"], x["adv"], old, None, x["mask"], **keywords)
    plain = gk.grpo_loss(hidden @ weight.T, x["targets"], x["adv"], old, None, x["mask"], inplace=False, **keywords)
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-12, atol=1e-12)
    for name in padded.metrics:
        torch.testing.assert_close(packed.metrics[name], padded.metrics[name], rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(fused.metrics[name], plain.metrics[name], rtol=1e-12, atol=1e-12, msg=name)
    grads = [torch.autograd.grad(out.loss, (hidden, weight)) for out in (fused, plain)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bypass", (False, True), ids=("decoupled", "bypass"))
def test_no_host_read(bypass):
    """With check_finite=False the heaviest correction, its metrics included, reads nothing on the host."""
    x = case(6, dtype=torch.float32)
    correction = RolloutCorrection(**{**_fields(HEAVY), "bypass_mode": bypass})
    logits = x["logits"].clone().requires_grad_()
    old = None if bypass else x["old"]
    with HostReads() as host:
        out = gk.grpo_loss(
            logits,
            x["targets"],
            x["adv"],
            old,
            None,
            x["mask"],
            sampling_logp=x["sampling"],
            check_finite=False,
            rollout_correction=correction,
            backend="triton",
        )  # fmt: skip  (triton: the Python path is the CUDA one; the torch pass reads its rows' test)
        out.loss.backward()
    assert host.reads == []


def _fields(correction: RolloutCorrection) -> dict:
    return {name: getattr(correction, name) for name in ("rollout_is", "rollout_is_threshold",
            "rollout_is_threshold_lower", "rollout_is_bounds", "rollout_is_batch_normalize", "rollout_rs",
            "rollout_rs_threshold")}  # fmt: skip


@pytest.mark.parametrize("function", ["grpo_loss", "fused_linear_grpo_loss"])
def test_no_graph_break(function):
    """torch.compile (aot_eager) with check_finite=False: the same loss and gradients as eager, no graph break."""
    pytest.importorskip("torch._dynamo")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        dict(embed=torch.nn.Embedding(V, H), layer=torch.nn.Linear(H, H), head=torch.nn.Linear(H, V, bias=False))
    )
    x = case(7, dtype=torch.float32)
    ids = torch.randint(0, V, (B, T))
    common = dict(check_finite=False, backend="torch", sampling_logp=x["sampling"], rollout_correction=HEAVY)

    def step(ids):
        hidden = torch.tanh(model["layer"](model["embed"](ids)))  # [B, T, H]
        args = (x["targets"], x["adv"], x["old"], None, x["mask"])
        if function == "grpo_loss":
            return gk.grpo_loss(hidden @ model["head"].weight.T, *args, **common).loss
        return gk.fused_linear_grpo_loss(hidden, model["head"].weight, *args, **common).loss

    breaks, reasons = _graph_breaks_against_eager(model, ids, step, lambda s: torch.compile(s, backend="aot_eager"))
    assert breaks == 0, reasons


@pytest.mark.parametrize(
    "fields, message",
    (
        (
            dict(rollout_is="token", rollout_is_threshold=0.0),
            "rollout_correction: rollout_is_threshold must be finite and > 0",
        ),
        (dict(rollout_is="token", rollout_is_threshold=-2.0), "rollout_is_threshold must be finite and > 0"),
        (dict(rollout_is="token", rollout_is_threshold=float("nan")), "rollout_is_threshold must be finite and > 0"),
        (dict(rollout_is="token", rollout_is_threshold="2.0_0.5"), "rollout_is_threshold must have lower <= upper"),
        (dict(rollout_is="token", rollout_is_threshold=1.0, rollout_is_threshold_lower=2.0), "lower must be <="),
        (dict(rollout_is="tokens"), "rollout_is must be one of"),
        (dict(rollout_rs="seq_mean_k4", rollout_rs_threshold=0.1), "rollout_rs must be one of"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold=0.0), "rollout_rs_threshold of token_k2 bounds must be"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="nan_2"), "rollout_rs_threshold of token_k1 bounds must be"),
        (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1.5,2,3"), "one threshold or one per statistic"),
        (dict(rollout_rs="seq_max_k3"), "rollout_rs_threshold is required"),
        (dict(geo_mask="1.1_0.9"), "geo_mask must have lower <= upper"),
        (dict(ipo_threshold=0.0), "ipo_threshold must be finite and > 0"),
        (dict(log_ratio_penalty=float("nan")), "log_ratio_penalty must be a finite float >= 0"),
        (dict(rollout_is_batch_normalize=True), "rollout_is_batch_normalize needs rollout_is"),
    ),
)
def test_bad_options(fields, message):
    with pytest.raises(ValueError, match=message):
        gk.LossOptions(rollout_correction=fields)


def test_bad_preset_and_field():
    with pytest.raises(ValueError, match="rollout_correction preset must be one of"):
        gk.LossOptions(rollout_correction="bypass_ppo")
    with pytest.raises(TypeError, match="rollout_correction: unknown field"):
        gk.LossOptions(rollout_correction={"rollout_iss": "token"})
    with pytest.raises(ValueError, match="is verl's REINFORCE: it needs loss_type='gpg'"):
        gk.LossOptions(rollout_correction="bypass_pg_is")
    assert gk.LossOptions(loss_type="gpg", rollout_correction="bypass_pg_is").rollout_correction.bypass_mode


@pytest.mark.parametrize(
    "change, message",
    (
        (dict(sampling_logp=None), "rollout_correction needs sampling_logp"),
        (dict(is_ratio=torch.ones(B)), "rollout_correction forms the IS weight"),
        (dict(old=None), r"decoupled: bypass_mode=False\) needs old_logp"),
    ),
)
def test_bad_inputs_before_any_kernel(change, message, monkeypatch):
    """A call missing what the correction reads is one ValueError, raised before the vocabulary pass."""
    x = case(8)
    monkeypatch.setattr(routes, "vocab_pass", None)  # a pass started would fail with a TypeError instead
    keywords = dict(sampling_logp=x["sampling"], rollout_correction=HEAVY)
    old = change.pop("old", x["old"])
    keywords.update(change)
    with pytest.raises(ValueError, match=message):
        gk.grpo_loss(x["logits"], x["targets"], x["adv"], old, None, x["mask"], **keywords)
    with pytest.raises(ValueError, match="bypass_mode takes old_logp from sampling_logp"):
        gk.grpo_loss(
            x["logits"], x["targets"], x["adv"], x["old"], None, x["mask"], sampling_logp=x["sampling"],
            rollout_correction=RolloutCorrection(bypass_mode=True),
        )  # fmt: skip

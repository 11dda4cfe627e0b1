"""Sampling replay through the losses and the fused lm_head, against the float64 oracle: grpo_loss (padded and
packed), GRPOLoss, fused_linear_token_logprobs (4 GEMMs) and fused_linear_grpo_loss (3 GEMMs), rule and kept-set
replay, the entropy of the support or the whole vocabulary, the sampling metrics; lean memory refused."""

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from tests.cases import Case
from tests.conftest import BACKENDS, DEVICE, assert_close
from tests.helpers import loss_inputs, oracle_logits
from tests.replay_cases import RULES, csr, oracle, padded, support_of

B, T, H, V = 3, 5, 16, 37
CHUNK = 3  # kept rows per chunk: not a divisor of the kept-token count
OPTIONS = {"loss_type": "dapo", "beta": 0.04, "temperature": 0.8}


def masked_logits(x: torch.Tensor, targets: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The oracle's replay as logits: -inf outside support ∪ {target} (the gradient flows inside only)."""
    hot = torch.nn.functional.one_hot(targets.cpu().long(), x.shape[-1]).bool()
    return x.masked_fill(~(support | hot), -math.inf)


def oracle_loss(x, inputs, support, entropy_coef: float = 0.0, full_entropy: bool = False, **options):
    """reference.grpo_loss over the replayed support (its metrics' entropy the support's, or the full one's)."""
    args = {k: inputs[k].cpu() for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")}
    coef = 0.0 if full_entropy else entropy_coef
    loss, metrics = reference.grpo_loss(
        masked_logits(x, args["targets"], support), **args, entropy_coef=coef, **options
    )
    if full_entropy:  # the bonus on the whole distribution's entropy
        _, entropy = reference.token_logprobs(x, args["targets"], temperature=options["temperature"])
        m = args["mask"].double()
        metrics["entropy"] = (entropy * m).sum() / m.sum()
        loss = loss - entropy_coef * metrics["entropy"]
    return loss, metrics


def sampling_metrics(inputs, support, temperature):
    want = oracle(inputs["logits"], inputs["targets"], support, temperature=temperature)
    m = inputs["mask"].cpu()
    return {
        "sampling/log_kept_mass": want["log_kept_mass"][m].mean(),
        "sampling/outside_support": want["outside_support"][m].double().mean(),
    }


@pytest.mark.parametrize("form", ("rule", "csr", "padded"))
@pytest.mark.parametrize("layout", ("padded", "packed"))
@pytest.mark.parametrize("loss_type", ("dapo", "grpo"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_loss_matches_oracle(backend, loss_type, layout, form):
    inputs = loss_inputs(Case("masked_row"), torch.float32, DEVICE)
    options = OPTIONS | {"loss_type": loss_type}
    support = support_of(inputs["logits"], RULES["all"], temperature=0.8)
    x = oracle_logits(inputs["logits"])
    want_loss, want_metrics = oracle_loss(x, inputs, support, **options)
    want_loss.backward()
    want_sampling = sampling_metrics(inputs, support, 0.8)  # before the in-place backward overwrites the logits
    rule = RULES["all"] if form == "rule" else {}  # loss options
    kept = {"rule": {}, "csr": {"sampling_mask": csr(support)}, "padded": {"sampling_mask": padded(support).to(DEVICE)}}
    kept = kept[form]  # a tensor keyword
    args = {k: inputs[k] for k in ("targets", "old_logp", "ref_logp", "mask")}
    logits = inputs["logits"].detach().requires_grad_()
    if layout == "packed":  # every sequence whole: [N, V] rows, [S] advantages
        args = {k: v.reshape(-1) for k, v in args.items()}
        kept = {k: v.flatten(0, 1) if isinstance(v, torch.Tensor) else v for k, v in kept.items()}
        cu_seqlens = torch.arange(0, B * T + 1, T, device=DEVICE)
        out = gk.grpo_loss(logits.view(B * T, V), advantages=inputs["advantages"], cu_seqlens=cu_seqlens,
                           backend=backend, **args, **kept, **options, **rule)  # fmt: skip
    else:
        out = gk.GRPOLoss(backend=backend, **options, **rule)(logits, advantages=inputs["advantages"], **args, **kept)
    out.loss.backward()
    assert_close(out.loss, want_loss, torch.float32, "loss")
    assert_close(logits.grad, x.grad, torch.float32, "grad logits")
    for name, value in want_sampling.items():
        assert_close(out.metrics[name], value, torch.float32, name)
    if "kl" in out.metrics:
        assert_close(out.metrics["kl"], want_metrics["kl"], torch.float32, "kl")


@pytest.mark.parametrize("replay_entropy", ("support", "full"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_of_the_support_or_the_whole_vocabulary(backend, replay_entropy):
    inputs = loss_inputs(Case("masked_row"), torch.float32, DEVICE)
    support = support_of(inputs["logits"], RULES["top_p"], temperature=0.8)
    x = oracle_logits(inputs["logits"])
    full = replay_entropy == "full"
    want_loss, want_metrics = oracle_loss(x, inputs, support, entropy_coef=0.1, full_entropy=full, **OPTIONS)
    want_loss.backward()
    logits = inputs["logits"].detach().requires_grad_()
    args = {k: inputs[k] for k in ("targets", "advantages", "old_logp", "ref_logp", "mask")}
    out = gk.grpo_loss(logits, **args, backend=backend, entropy_coef=0.1, replay_entropy=replay_entropy, **OPTIONS,
                       **RULES["top_p"])  # fmt: skip
    out.loss.backward()
    assert_close(out.loss, want_loss, torch.float32, "loss")
    assert_close(out.metrics["entropy"], want_metrics["entropy"], torch.float32, "entropy")
    assert_close(logits.grad, x.grad, torch.float32, "grad logits")


def linear_inputs(dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[-1] = False
    inputs = {"hidden": hidden, "weight": weight, "bias": bias, "targets": targets, "mask": mask}
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def linear_support(inputs, rule, temperature):
    """The rule's support of the logits as the lm_head GEMM gives them in the input dtype (bf16 logits are rounded
    before the rule cuts them, as a sampler's are)."""
    logits = torch.nn.functional.linear(inputs["hidden"], inputs["weight"], inputs["bias"])
    return support_of(logits, rule, temperature=temperature)


def double_leaves(inputs):
    return {k: inputs[k].detach().double().cpu().requires_grad_() for k in ("hidden", "weight", "bias")}


@pytest.mark.parametrize("form", ("rule", "padded"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_logprobs_match_oracle(backend, dtype, form):
    """The 4-GEMM route (log-probs out, any loss on top): logp, entropy, log kept mass, dH, dW, db."""
    inputs = linear_inputs(dtype)
    support = linear_support(inputs, RULES["all"], 0.8)
    replay = RULES["all"] if form == "rule" else {"sampling_mask": padded(support).to(DEVICE)}
    leaves = {k: inputs[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    got = gk.fused_linear_token_logprobs(
        leaves["hidden"], leaves["weight"], inputs["targets"], bias=leaves["bias"], mask=inputs["mask"],
        temperature=0.8, with_entropy=True, stats=("log_kept_mass", "outside_support"), chunk_size=CHUNK,
        backend=backend, **replay,
    )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    w_logp, w_ent = torch.randn(2, B, T, generator=g).to(DEVICE)
    ((got["logp"] * w_logp).sum() + (got["entropy"] * w_ent).sum()).backward()
    ref = double_leaves(inputs)
    logits = torch.nn.functional.linear(ref["hidden"], ref["weight"], ref["bias"])
    want = reference.token_logprobs(logits, inputs["targets"].cpu(), temperature=0.8, support=support)
    m = inputs["mask"].cpu().double()
    ((want[0] * m * w_logp.cpu()).sum() + (want[1] * m * w_ent.cpu()).sum()).backward()
    assert_close(got["logp"], want[0] * m, dtype, "logp")
    assert_close(got["entropy"], want[1] * m, dtype, "entropy")
    for name in ("hidden", "weight", "bias"):
        assert_close(leaves[name].grad, ref[name].grad, dtype, f"grad {name}")
    assert (got["log_kept_mass"][inputs["mask"]] < 0).all() and not got["log_kept_mass"][~inputs["mask"]].any()


@pytest.mark.parametrize("replay_entropy", ("support", "full"))
@pytest.mark.parametrize("form", ("rule", "csr"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_grpo_loss_matches_oracle(backend, form, replay_entropy, launches):
    """The 3-GEMM route (gradients formed in the forward) under replay: loss, metrics, dH, dW, db."""
    inputs = linear_inputs(torch.float32)
    support = linear_support(inputs, RULES["all"], 0.8)
    replay = RULES["all"] if form == "rule" else {"sampling_mask": csr(support)}
    g = torch.Generator().manual_seed(1)
    side = {
        "advantages": torch.randn(B, generator=g).to(DEVICE),
        "old_logp": (-2 + 0.3 * torch.randn(B, T, generator=g)).to(DEVICE),
        "ref_logp": (-2 + 0.3 * torch.randn(B, T, generator=g)).to(DEVICE),
    }
    leaves = {k: inputs[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    out = gk.fused_linear_grpo_loss(
        leaves["hidden"], leaves["weight"], inputs["targets"], mask=inputs["mask"], bias=leaves["bias"],
        chunk_size=CHUNK, backend=backend, entropy_coef=0.1, replay_entropy=replay_entropy, **side, **OPTIONS,
        **replay,
    )  # fmt: skip
    out.loss.backward()
    assert launches["fused_linear_token_loss"] == 1, "the 3-GEMM route ran"
    ref = double_leaves(inputs)
    logits = torch.nn.functional.linear(ref["hidden"], ref["weight"], ref["bias"])
    want_loss, _ = oracle_loss(logits, inputs | side, support, entropy_coef=0.1,
                               full_entropy=replay_entropy == "full", **OPTIONS)  # fmt: skip
    want_loss.backward()
    assert_close(out.loss, want_loss, torch.float32, "loss")
    for name in ("hidden", "weight", "bias"):
        assert_close(leaves[name].grad, ref[name].grad, torch.float32, f"grad {name}")
    want = oracle(logits.detach(), inputs["targets"], support, temperature=0.8)
    m = inputs["mask"].cpu()
    assert_close(out.metrics["sampling/log_kept_mass"], want["log_kept_mass"][m].mean(), torch.float32, "kept mass")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_packed_equals_padded(backend):
    """The packed layout ([N, H] rows, cu_seqlens, [N, K] kept ids) gives the padded layout's loss and gradients."""
    inputs = linear_inputs(torch.float32)
    inputs["mask"][:] = True
    support = linear_support(inputs, RULES["all"], 0.8)
    ids = padded(support).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    side = {"advantages": torch.randn(B, generator=g).to(DEVICE), "old_logp": torch.full((B, T), -2.0, device=DEVICE)}
    side["ref_logp"] = side["old_logp"] - 0.3
    results = []
    for packed in (False, True):
        leaves = {k: inputs[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
        flat = (lambda x: x.flatten(0, 1)) if packed else (lambda x: x)  # noqa: E731
        extra = {"cu_seqlens": torch.arange(0, B * T + 1, T, device=DEVICE)} if packed else {}
        out = gk.fused_linear_grpo_loss(
            flat(leaves["hidden"]), leaves["weight"], flat(inputs["targets"]), side["advantages"],
            flat(side["old_logp"]), flat(side["ref_logp"]), bias=leaves["bias"], sampling_mask=flat(ids),
            chunk_size=CHUNK, backend=backend, **extra, **OPTIONS,
        )  # fmt: skip
        out.loss.backward()
        results.append((out.loss, *(leaves[k].grad for k in ("hidden", "weight", "bias"))))
    for name, a, b in zip(("loss", "dH", "dW", "db"), *results, strict=True):
        assert_close(a, b, torch.float32, f"packed {name}")


def test_lean_memory_is_refused_and_auto_runs_fast():
    inputs = linear_inputs(torch.float32)
    args = (inputs["hidden"], inputs["weight"], inputs["targets"])
    with pytest.raises(ValueError, match="memory='lean' .*cannot replay"):
        gk.fused_linear_token_logprobs(*args, memory="lean", top_k=3, backend="torch")
    with pytest.raises(ValueError, match="memory='lean' .*cannot replay"):
        gk.fused_linear_token_logprobs(*args, tile=(2, 8), top_p=0.5, backend="torch")
    auto = gk.fused_linear_token_logprobs(*args, memory="auto", top_k=3, backend="torch")
    fast = gk.fused_linear_token_logprobs(*args, memory="fast", top_k=3, backend="torch")
    assert torch.equal(auto, fast)

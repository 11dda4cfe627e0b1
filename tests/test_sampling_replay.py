"""Sampling replay on the logits API against the float64 oracle (`reference.token_logprobs(support=
reference.sampler_support(...))`): logp, entropy, log kept mass, outside flags and the gradient, every backend, the
hard cases, the kept-set forms, and the errors."""

import math

import pytest
import torch

import grpo_kernels as gk
from tests.cases import CASE_IDS, CASES, Case, make_inputs
from tests.conftest import BACKENDS, DEVICE, DTYPES, assert_close
from tests.replay_cases import RULES, STATS, csr, oracle, padded, support_of


def check_replay(logits, targets, mask, backend, dtype, *, support, inplace=True, launches=None, **kwargs):
    """token_logprobs with replay (`kwargs`: the rule or sampling_mask, the transform) against the oracle on
    `support`; returns the result dict."""
    transform = {k: kwargs[k] for k in ("temperature", "logit_scale", "final_logit_softcapping") if k in kwargs}
    g = torch.Generator().manual_seed(7)
    w_logp, w_ent = torch.randn(2, *mask.shape, generator=g).to(DEVICE)
    want = oracle(logits, targets, support, **transform)  # before the in-place backward overwrites the logits
    logits = logits.requires_grad_()
    got = gk.token_logprobs(
        logits, targets, mask=mask, with_entropy=True, stats=STATS, backend=backend, inplace=inplace, **kwargs
    )
    ((got["logp"] * w_logp).sum() + (got["entropy"] * w_ent).sum()).backward()
    if launches is not None:
        assert launches[backend] == 2 and sum(launches.values()) == 2
    m = mask.cpu().double()
    ((want["logp"] * m * w_logp.cpu()).sum() + (want["entropy"] * m * w_ent.cpu()).sum()).backward()
    assert_close(got["logp"], want["logp"] * m, dtype, "logp")
    assert_close(got["entropy"], want["entropy"] * m, dtype, "entropy")
    assert_close(got["log_kept_mass"], want["log_kept_mass"] * m, dtype, "log kept mass")
    assert torch.equal(got["outside_support"].cpu(), want["outside_support"] & mask.cpu()), "outside flags"
    assert (got["log_kept_mass"] <= 0).all()
    assert_close(logits.grad, want["x"].grad, dtype, "grad logits")
    if inplace:
        assert torch.equal(logits.detach(), logits.grad), "the in-place backward leaves the gradient in the logits"
    return got


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rule_matches_oracle_on_the_hard_cases(backend, dtype, case, launches):
    inputs = make_inputs(case, dtype, DEVICE)
    rule = RULES["all"]
    support = support_of(inputs["logits"], rule, temperature=case.temperature)
    check_replay(
        inputs["logits"],
        inputs["targets"],
        inputs["mask"],
        backend,
        dtype,
        support=support,
        temperature=case.temperature,
        launches=launches,
        **rule,
    )


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_rule_with_the_transform(backend, rule):
    """Each rule alone, on z = c·tanh(s·x/c) / T; the support is cut on z, the chain rule applies inside it."""
    inputs = make_inputs(Case("temperature"), torch.float32, DEVICE)
    transform = {"temperature": 0.7, "logit_scale": 1.5, "final_logit_softcapping": 6.0}
    support = support_of(inputs["logits"], RULES[rule], **transform)
    assert support.sum(-1)[inputs["mask"].cpu()].lt(inputs["logits"].shape[-1]).all(), "the rule truncates"
    got = check_replay(
        inputs["logits"], inputs["targets"], inputs["mask"], backend,
        torch.float32, support=support, inplace=False, **transform, **RULES[rule],
    )  # fmt: skip
    assert got["outside_support"].any() and (got["log_kept_mass"][inputs["mask"]] < 0).all()


@pytest.mark.parametrize("form", ("csr", "padded", "padded_flat"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_set_from_the_rule_equals_rule_replay(backend, form):
    inputs = make_inputs(Case("masked_row"), torch.float32, DEVICE)
    logits, targets, mask = inputs["logits"], inputs["targets"], inputs["mask"]
    support = support_of(logits, RULES["all"], temperature=0.8)
    rule = gk.token_logprobs(logits, targets, mask=mask, temperature=0.8, with_entropy=True, backend=backend,
                             **RULES["all"])  # fmt: skip
    kept = {"csr": csr(support), "padded": padded(support), "padded_flat": padded(support).flatten(0, 1)}[form]
    if form != "csr":
        kept = kept.to(DEVICE)
    got = check_replay(
        logits.clone(), targets, mask, backend, torch.float32, support=support, temperature=0.8, sampling_mask=kept
    )
    assert_close(got["logp"], rule[0], torch.float32, "kept set vs rule: logp")
    assert_close(got["entropy"], rule[1], torch.float32, "kept set vs rule: entropy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_logits_equal_padded(backend):
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    logits, targets, mask = inputs["logits"], inputs["targets"], inputs["mask"]
    B, T, V = logits.shape
    padded_out = gk.token_logprobs(logits, targets, mask=mask, backend=backend, stats=STATS, **RULES["all"])
    flat_out = gk.token_logprobs(logits.reshape(B * T, V), targets.reshape(-1), mask=mask.reshape(-1),
                                 backend=backend, stats=STATS, **RULES["all"])  # fmt: skip
    for name, x in padded_out.items():
        assert torch.equal(flat_out[name], x.reshape(-1)), name


def peaked(B: int = 2, T: int = 3, V: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, T, V, generator=g).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_kth_logit_are_all_kept(backend):
    logits = peaked()
    logits[..., :6] = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 2.9])  # the 3rd largest is tied three ways
    targets = torch.full(logits.shape[:2], 4, device=DEVICE)
    targets[0, 0] = 5  # just below the cut: outside
    mask = torch.ones(logits.shape[:2], dtype=torch.bool, device=DEVICE)
    support = support_of(logits, {"top_k": 3})
    assert (support.sum(-1) == 5).all()
    got = check_replay(logits, targets, mask, backend, torch.float32, support=support, top_k=3)
    assert got["outside_support"].sum() == 1 and got["outside_support"][0, 0]
    kept = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0]).logsumexp(0)
    assert_close(got["logp"][0, 1], 3.0 - kept, torch.float32, "a tied target's logp")
    # top-p after top-k renormalises over every tied token: with the ties 0.65 of the mass leads, without them 0.88
    logits = torch.full_like(logits.detach(), -5.0)
    logits[..., :6] = torch.tensor([2.0, 0.0, 0.0, 0.0, 0.0, -1.0])
    support = support_of(logits, {"top_k": 2, "top_p": 0.7})
    assert (support.sum(-1) == 5).all()
    check_replay(logits, targets, mask, backend, torch.float32, support=support, top_k=2, top_p=0.7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rules_that_keep_everything_give_the_plain_pass(backend):
    """top_p 1.0 exactly, top_k >= V, min_p 0: the plain log-probs and entropy, log kept mass exactly 0."""
    logits, V = peaked(), peaked().shape[-1]
    targets = torch.randint(0, V, logits.shape[:2], generator=torch.Generator().manual_seed(0)).to(DEVICE)
    plain = gk.token_logprobs(logits, targets, with_entropy=True, backend=backend)
    for rule in ({"top_p": 1.0}, {"top_k": V}, {"top_k": V + 5}, {"top_k": V, "top_p": 1.0, "min_p": 0.0}):
        got = gk.token_logprobs(logits, targets, with_entropy=True, stats=STATS, backend=backend, **rule)
        assert_close(got["logp"], plain[0], torch.float32, f"{rule} logp")
        assert_close(got["entropy"], plain[1], torch.float32, f"{rule} entropy")
        assert torch.equal(got["log_kept_mass"], torch.zeros_like(plain[0])) and not got["outside_support"].any()
    stats = gk.token_logprobs(logits, targets, stats=STATS, backend=backend)  # asked without replay: 0 and False
    assert not stats["log_kept_mass"].any() and not stats["outside_support"].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_mass_on_one_token(backend):
    logits = peaked()
    logits[..., 2] = 60.0
    targets = torch.full(logits.shape[:2], 2, device=DEVICE)
    targets[:, 0] = 7  # a sampled token the rule cuts: counted as kept, finite, flagged
    mask = torch.ones(logits.shape[:2], dtype=torch.bool, device=DEVICE)
    for rule in ({"top_p": 0.5}, {"top_k": 1}, {"min_p": 0.01}):
        support = support_of(logits, rule)
        assert (support.sum(-1) == 1).all()
        got = check_replay(logits.clone(), targets, mask, backend, torch.float32, support=support, **rule)
        assert torch.isfinite(got["logp"]).all() and got["outside_support"][:, 0].all()
        assert not got["outside_support"][:, 1:].any() and (got["logp"][:, 1:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_set_with_a_target_outside(backend):
    logits = peaked()
    targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=DEVICE)
    support = torch.zeros(*logits.shape, dtype=torch.bool)
    support[..., 3:6] = True  # target 0 lies outside at every position
    support[0, 0, 0] = True
    mask = torch.ones(logits.shape[:2], dtype=torch.bool, device=DEVICE)
    got = check_replay(logits, targets, mask, backend, torch.float32, support=support, sampling_mask=csr(support))
    assert got["outside_support"].sum() == mask.numel() - 1 and not got["outside_support"][0, 0]
    assert torch.isfinite(got["logp"]).all() and math.isfinite(float(got["entropy"].detach().sum()))


def test_errors_name_the_argument():
    inputs = make_inputs(Case("ragged_vocab"), torch.float32, DEVICE)
    logits, targets, V = inputs["logits"], inputs["targets"], inputs["logits"].shape[-1]
    call = lambda **kw: gk.token_logprobs(logits, targets, mask=inputs["mask"], backend="torch", **kw)  # noqa: E731
    support = torch.ones(*logits.shape, dtype=torch.bool)
    bad = [
        ({"top_k": -1}, ValueError, "top_k must be an int >= 0"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"min_p": 1.0}, ValueError, r"min_p must be in \[0, 1\)"),
        ({"min_p": -0.1}, ValueError, r"min_p must be in \[0, 1\)"),
        ({"top_k": 3, "sampling_mask": csr(support)}, ValueError, "sampling_mask .*not both"),
        ({"sampling_mask": padded(support) + V}, ValueError, "sampling_mask ids must lie in"),
        ({"sampling_mask": padded(support)[:, :-1]}, ValueError, r"sampling_mask must be \[B, T, K\]"),
        ({"sampling_mask": support}, TypeError, "sampling_mask must be"),
        ({"sampling_mask": gk.SamplingMask(torch.arange(3), torch.tensor([0, 3]))}, ValueError, "offsets must have"),
        ({"sampling_mask": gk.SamplingMask(torch.zeros(3), torch.zeros(16))}, TypeError, "token_ids must be"),
        ({"top_k": 3, "stats": ("mean_logits",)}, ValueError, "whole vocabulary"),
    ]
    offsets = torch.zeros(logits.shape[:2].numel() + 1, dtype=torch.long)
    offsets[1], offsets[-1] = 2, 1
    bad.append(
        ({"sampling_mask": gk.SamplingMask(torch.zeros(1, dtype=torch.long), offsets)}, ValueError, "never decrease")
    )
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            call(**kwargs)
    with pytest.raises(ValueError, match="top_p must be in"):
        gk.LossOptions(top_p=0.0)
    with pytest.raises(ValueError, match="replay_entropy must be one of"):
        gk.LossOptions(replay_entropy="all")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_fully_masked_inputs(backend):
    """B = 0, and every token masked: zeros and zero gradients, under rule and kept-set replay, logits and lm_head."""
    for B in (0, 2):
        logits = torch.randn(B, 3, 11, device=DEVICE, requires_grad=True)
        targets = torch.zeros(B, 3, dtype=torch.long, device=DEVICE)
        mask = torch.zeros(B, 3, dtype=torch.bool, device=DEVICE)
        ids = torch.full((B, 3, 2), -1, device=DEVICE)
        for replay in ({"top_k": 2, "top_p": 0.5}, {"sampling_mask": ids}):
            out = gk.token_logprobs(logits, targets, mask=mask, stats=STATS, backend=backend, inplace=False, **replay)
            out["logp"].sum().backward()
            assert not out["logp"].any() and not out["log_kept_mass"].any() and not logits.grad.any()
            hidden, weight = torch.randn(B, 3, 4, device=DEVICE), torch.randn(11, 4, device=DEVICE)
            logp = gk.fused_linear_token_logprobs(hidden, weight, targets, mask=mask, backend=backend, **replay)
            assert logp.shape == (B, 3) and not logp.any()


GPU_BACKENDS = tuple(b for b in BACKENDS if b != "torch")  # triton, and cuda where the extension is built


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_gpu_backends_replay_a_vocabulary_wider_than_a_block(dtype):
    """The GPU plan's check: triton and cuda replay V = 5,003 (wider than a kernel block) on the GPU, logits and the
    fused lm_head, against the oracle."""
    case = Case("multi_block_vocab", temperature=0.7)
    for backend in GPU_BACKENDS:
        inputs = make_inputs(case, dtype, DEVICE)
        support = support_of(inputs["logits"], RULES["all"], temperature=0.7)
        check_replay(inputs["logits"], inputs["targets"], inputs["mask"], backend, dtype, support=support,
                     temperature=0.7, **RULES["all"])  # fmt: skip
        hidden = torch.randn(16, 64, device=DEVICE)  # float32: the same logits in both GEMMs, so the same support
        weight = torch.randn(case.V, 64, device=DEVICE) / 4
        targets = torch.randint(0, case.V, (16,), device=DEVICE)
        got = gk.fused_linear_token_logprobs(hidden, weight, targets, backend=backend, **RULES["all"])
        logits = torch.nn.functional.linear(hidden, weight)
        want = gk.token_logprobs(logits, targets, backend="torch", **RULES["all"])
        assert_close(got, want, torch.float32, f"{backend} fused lm_head")


@pytest.mark.parametrize("tie_row", [0, 2], ids=["first_window", "last_window"])
def test_top_k_narrow_rows_fall_back_to_masking_on_a_tie_beyond_the_candidates(monkeypatch, tie_row):
    """A fused lm_head chunk of three rows in windows of one: top-k's candidates gather each window's support into
    narrow rows until a window ties at the k-th beyond them; then the whole chunk, the windows before it too, is
    masked instead. logp and dL/dhidden against the oracle, ties all kept."""
    from grpo_kernels.kernels import replay

    V, H, k = 16, 8, 3
    monkeypatch.setattr(replay, "WINDOW_ELEMENTS", V)  # one row per window
    g = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(V, H, generator=g), torch.randn(1, 3, H, generator=g)
    weight[:5] = weight[0] * 4.0  # tokens 0..4 share each row's logit: the largest in `tie_row`, the least elsewhere
    u = weight[0] / weight[0].norm()
    hidden[0] -= (hidden[0] @ u)[:, None] * u + 2 * u
    hidden[0, tie_row] = u
    targets = torch.tensor([[7, 0, 4]])
    logits = (hidden.double() @ weight.double().T).float()
    support = support_of(logits, {"top_k": k})
    assert support[0, tie_row].sum() == 5 and support[0, 1].sum() == k, "five tied at the top in one row only"
    hidden.requires_grad_()
    got = gk.fused_linear_token_logprobs(hidden, weight, targets, top_k=k, backend="torch")
    w = torch.randn(1, 3, generator=g)
    (got * w).sum().backward()
    want = oracle(logits, targets, support)
    (want["logp"] * w.double()).sum().backward()
    assert_close(got, want["logp"], torch.float32, "logp")
    assert_close(hidden.grad, want["x"].grad @ weight.double(), torch.float32, "grad hidden")

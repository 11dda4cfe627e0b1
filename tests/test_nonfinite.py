"""Non-finite values are never hidden: not in the inputs, the logits, the loss or the gradients.

- NaN/±inf at a kept token in any tensor argument is a ValueError naming the tensor and the first bad index, raised
  before any kernel; at masked positions anything goes (it is never read).
- A kept row of logits (or of hidden @ weight.T + bias) with a non-finite log-sum-exp is a ValueError naming the
  row, found from the pass's O(N) statistics; a target whose logit is -inf gives logp = -inf (as TRL) and is an
  error in a loss.
- `check_finite=False` skips the checks, and then no backend returns a finite loss over non-finite gradients.
- Logits an in-place backward overwrote are refused by a later call (the in-place contract).
"""

import inspect
import math

import pytest
import torch

import grpo_kernels as gk
from tests.conftest import BACKENDS, DEVICE
from tests.helpers import TRITON_INTERPRETED, kernel_forms_loss

B, T, V, H = 3, 4, 37, 16
KEPT, MASKED = (1, 2), (0, 3)  # a kept token, and a masked one; sequence 2 is fully masked
PATHS = {  # the triton backend's fused epilogue (token) and its two-phase path (sequence)
    "token": dict(loss_type="dapo", beta=0.04),
    "sequence": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
}
PER_TOKEN = ("old_logp", "ref_logp", "sampling_logp", "is_ratio", "token_weights", "advantages_per_token")
PER_SEQUENCE = ("advantages", "sequence_weights")
BAD = (math.nan, math.inf, -math.inf)


def make(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 2
    bias = torch.randn(V, generator=g)
    logits = hidden @ weight.T + bias
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[MASKED] = False
    mask[2] = False
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    d = {
        "hidden": hidden,
        "weight": weight,
        "bias": bias,
        "logits": logits,
        "targets": targets,
        "mask": mask,
        "advantages": torch.randn(B, generator=g),
        "old_logp": logp + 0.3 * torch.randn(B, T, generator=g),
        "ref_logp": logp + 0.3 * torch.randn(B, T, generator=g),
        "sampling_logp": logp + 0.3 * torch.randn(B, T, generator=g),
        "is_ratio": 0.5 + torch.rand(B, T, generator=g),
        "token_weights": 0.5 + torch.rand(B, T, generator=g),
        "sequence_weights": 0.5 + torch.rand(B, generator=g),
    }
    return {k: v.to(DEVICE) for k, v in d.items()}


def loss(fn: str, d: dict, backend: str, path: str = "token", per_token_advantages: bool = False, **kw):
    """(output, the leaves that get gradients) of grpo_loss / fused_linear_grpo_loss on `d` with every tensor."""
    tensors = {k: d[k] for k in ("sampling_logp", "is_ratio", "token_weights", "sequence_weights")}
    adv = d.get("advantages_per_token") if per_token_advantages else d["advantages"]
    args = (d["targets"], adv, d["old_logp"], d["ref_logp"], d["mask"])
    options = {**PATHS[path], **kw}
    if fn == "grpo_loss":
        logits = d["logits"].detach().clone().requires_grad_()
        return gk.grpo_loss(logits, *args, **tensors, backend=backend, **options), [logits]
    p = [d[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    out = gk.fused_linear_grpo_loss(p[0], p[1], *args, bias=p[2], **tensors, chunk_size=4, backend=backend, **options)
    return out, p


def with_value(d: dict, name: str, index, value: float) -> dict:
    d = dict(d)
    if name == "advantages_per_token":
        d[name] = d["advantages"][:, None].expand(B, T).clone()
    else:
        d[name] = d[name].clone()
    d[name][index] = value
    return d


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", ["grpo_loss", "fused_linear_grpo_loss"])
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", PER_TOKEN + PER_SEQUENCE)
def test_nonfinite_input_at_a_kept_token_raises_before_any_kernel(name, value, fn, backend, launches):
    if name == "sampling_logp" and math.isnan(value):
        pytest.skip("NaN is TRL's mark of a token the sampler could not score: test_unscored_sampler_tokens")
    index = KEPT if name in PER_TOKEN else KEPT[0]
    d = with_value(make(), name, index, value)
    shown = name.removesuffix("_per_token")
    where = f"\\({index[0]}, {index[1]}\\)" if name in PER_TOKEN else str(index)
    match = f"{shown} must be finite where the mask keeps a token, got {value} at index {where}"
    with pytest.raises(ValueError, match=match):
        loss(fn, d, backend, per_token_advantages=name == "advantages_per_token")
    assert not launches


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", ["grpo_loss", "fused_linear_grpo_loss"])
def test_unscored_sampler_tokens_are_no_evidence(fn, backend):
    """sampling_logp NaN at a kept token is TRL's mark of a token vLLM could not score (get_off_policy_mask
    counts it as no evidence), so it passes the check."""
    d = with_value(make(), "sampling_logp", KEPT, math.nan)
    out, leaves = loss(fn, d, backend, off_policy_mask_threshold=0.05)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in leaves)


@pytest.mark.parametrize("value", [math.nan, torch.tensor(math.inf)])
def test_nonfinite_normaliser_raises(value):
    d = make()
    with pytest.raises(ValueError, match="num_items_in_batch must be (finite|> 0, got nan)"):
        loss("grpo_loss", d, "torch", num_items_in_batch=value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fn", ["grpo_loss", "fused_linear_grpo_loss"])
def test_nonfinite_values_at_masked_positions_are_never_read(fn, path, backend):
    """NaN in every tensor at masked tokens (and in the fully masked sequence's per-sequence values) changes
    nothing: the loss, the metrics and the gradients equal those of the clean inputs, and are finite."""
    clean = make()
    dirty = dict(clean)
    dirty["advantages_per_token"] = clean["advantages"][:, None].expand(B, T).clone()
    clean = dict(dirty)
    for name in PER_TOKEN + ("logits", "hidden"):
        dirty[name] = dirty[name].clone()
        dirty[name][~dirty["mask"]] = math.nan
    for name in PER_SEQUENCE:
        dirty[name] = dirty[name].clone()
        dirty[name][2] = math.inf
    dirty["targets"] = dirty["targets"].masked_fill(~dirty["mask"], -100)
    results = []
    for d in (clean, dirty):
        out, leaves = loss(fn, d, backend, path, per_token_advantages=True)
        out.loss.backward()
        results.append((out, [p.grad for p in leaves]))
    (out, grads), (out_dirty, grads_dirty) = results
    assert torch.isfinite(out_dirty.loss) and torch.equal(out.loss, out_dirty.loss)
    for name, value in out.metrics.items():
        assert torch.equal(value, out_dirty.metrics[name]), name
    for g, g_dirty in zip(grads, grads_dirty, strict=True):
        assert torch.isfinite(g_dirty).all() and torch.equal(g, g_dirty)


LOGIT_FAULTS = {  # how a kept row's log-sum-exp stops being finite
    "nan": (math.nan, {}),
    "inf": (math.inf, {}),
    "row_of_neg_inf": (-math.inf, {}),
    "overflow": (1e38, {"temperature": 0.01}),  # 1e38 / 0.01 is inf in float32
}


def faulty_logits(d: dict, fault: str) -> tuple[torch.Tensor, dict]:
    value, options = LOGIT_FAULTS[fault]
    logits = d["logits"].clone()
    if fault == "row_of_neg_inf":
        logits[KEPT] = value
    else:
        logits[KEPT][(d["targets"][KEPT] + 1) % V] = value  # not the target: the lse alone must tell
    return logits, options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", LOGIT_FAULTS)
@pytest.mark.parametrize("call", ["token_logprobs", "token", "sequence"])
def test_nonfinite_logits_at_a_kept_row_raise(call, fault, backend):
    """Before: the triton fused loss returned a finite loss (0 with NaN gradients) for a NaN logit."""
    d = make()
    logits, options = faulty_logits(d, fault)
    logits.requires_grad_()
    match = "logits must have a finite log-sum-exp at kept tokens, got .* at index \\(1, 2\\)"
    with pytest.raises(ValueError, match=match):
        if call == "token_logprobs":
            gk.token_logprobs(logits, d["targets"], mask=d["mask"], backend=backend, **options)
        else:
            args = (d["targets"], d["advantages"], d["old_logp"], d["ref_logp"], d["mask"])
            gk.grpo_loss(logits, *args, backend=backend, **PATHS[call], **options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("call", ["fused_linear_token_logprobs", "token", "sequence"])
def test_nonfinite_hidden_or_weight_raise(call, value, where, backend):
    d = dict(make())
    d[where] = d[where].clone()
    index = {"hidden": (*KEPT, 0), "weight": (5, 0), "bias": 5}[where]
    d[where][index] = value
    first = KEPT
    if where != "hidden":  # a bad lm_head row spoils every row but those where it gives -inf (a legal logit)
        column = d["hidden"][..., 0] * value if where == "weight" else torch.full((B, T), value)
        first = tuple(int(i) for i in ((column != -math.inf) & d["mask"]).nonzero()[0])
    match = "hidden @ weight.T \\+ bias must have a finite log-sum-exp at kept tokens, got .* at index "
    match += f"\\({first[0]}, {first[1]}\\)"
    with pytest.raises(ValueError, match=match):
        if call == "fused_linear_token_logprobs":
            gk.fused_linear_token_logprobs(
                d["hidden"], d["weight"], d["targets"], bias=d["bias"], mask=d["mask"], chunk_size=4, backend=backend
            )
        else:
            loss("fused_linear_grpo_loss", d, backend, call)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", ["grpo_loss", "fused_linear_grpo_loss"])
def test_packed_layout_names_the_token(fn, backend):
    """With cu_seqlens the index is the packed token's n, for side inputs and for the logits' rows."""
    d = make()
    mask = d["mask"].reshape(-1)
    n = KEPT[0] * T + KEPT[1]
    packed = {
        "targets": d["targets"].reshape(-1),
        "advantages": d["advantages"],
        "old_logp": d["old_logp"].reshape(-1),
        "mask": mask,
        "cu_seqlens": torch.arange(0, B * T + 1, T, device=DEVICE),
    }

    def run(old_logp, logits, hidden):
        kw = {**packed, "old_logp": old_logp}
        if fn == "grpo_loss":
            return gk.grpo_loss(logits, backend=backend, **kw)
        return gk.fused_linear_grpo_loss(hidden, d["weight"], backend=backend, bias=d["bias"], **kw)

    old = packed["old_logp"].clone()
    old[n] = math.nan
    match = f"old_logp must be finite where the mask keeps a token, got nan at index {n}$"
    with pytest.raises(ValueError, match=match):
        run(old, d["logits"].reshape(B * T, V), d["hidden"].reshape(B * T, H))
    logits, hidden = d["logits"].reshape(B * T, V).clone(), d["hidden"].reshape(B * T, H).clone()
    logits[n, 0] = hidden[n, 0] = math.nan
    with pytest.raises(ValueError, match=f"finite log-sum-exp at kept tokens, got nan \\(logp nan\\) at index {n}:"):
        run(packed["old_logp"], logits, hidden)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_target_of_probability_zero(backend):
    """A -inf target logit (the rest of the row finite, other -inf entries legal): logp = -inf as in TRL from the
    log-prob functions; a loss refuses it (its ratio and log terms are undefined) unless check_finite=False, where
    the clipped loss computes with ratio 0 as TRL does, with a finite loss and finite gradients."""
    d = make()
    logits = d["logits"].clone()
    logits[0, 0, (d["targets"][0, 0] + 3) % V] = -math.inf  # a masked vocabulary entry: legal
    logits[KEPT][d["targets"][KEPT]] = -math.inf
    logp = gk.token_logprobs(logits, d["targets"], mask=d["mask"], backend=backend)
    others = d["mask"].clone()
    others[KEPT] = False
    assert logp[KEPT] == -math.inf and torch.isfinite(logp[others]).all()
    bias = d["bias"].clone()
    bias[d["targets"][KEPT]] = -math.inf
    logp = gk.fused_linear_token_logprobs(
        d["hidden"], d["weight"], d["targets"], bias=bias, mask=d["mask"], backend=backend
    )
    assert logp[KEPT] == -math.inf
    args = (d["targets"], d["advantages"], d["old_logp"], None, d["mask"])
    with pytest.raises(ValueError, match="give the target token probability 0 .* at index \\(1, 2\\)"):
        gk.grpo_loss(logits.clone(), *args, backend=backend)
    leaf = logits.clone().requires_grad_()
    out = gk.grpo_loss(leaf, *args, backend=backend, check_finite=False)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(leaf.grad).all()


UNCHECKED_FAULTS = ("nan_logit", "inf_logit", "overflow", "nan_hidden", "inf_weight") + tuple(
    f"nan_{name}" for name in ("advantages", "old_logp", "ref_logp", "is_ratio", "token_weights", "sequence_weights")
)


KERNEL_FAULTS = ("nan_logit", "inf_logit", "overflow", "nan_hidden", "inf_weight")  # the vocabulary pass reads them
# one input of each shape that only the PyTorch loss algebra reads: the kernel then sees a NaN dL/dlogp
ALGEBRA_FAULTS = ("nan_advantages", "nan_old_logp")


def kernel_reads(fault: str, fn: str, path: str) -> bool:
    """Whether the fault reaches Triton's kernels other than as a NaN dL/dlogp: the logits (hidden, weight), or any
    input on a path whose loss the kernel forms itself (grpo_loss's fused epilogue)."""
    fused = fn == "grpo_loss" and kernel_forms_loss("triton", **PATHS[path])
    return fault in KERNEL_FAULTS or fused


# Under the interpreter Triton runs the faults its kernels read, and ALGEBRA_FAULTS where only the algebra reads
# them (the torch cells run every fault through the same algebra)
UNCHECKED_CELLS = [
    (backend, fault, fn, path)
    for backend in BACKENDS
    for fault in UNCHECKED_FAULTS
    for fn in ("grpo_loss", "fused_linear_grpo_loss")
    for path in PATHS
    if not (fn == "grpo_loss" and fault in ("nan_hidden", "inf_weight"))  # the fused lm_head's
    and not (
        backend == "triton" and TRITON_INTERPRETED and not kernel_reads(fault, fn, path) and fault not in ALGEBRA_FAULTS
    )
]


@pytest.mark.parametrize("backend,fault,fn,path", UNCHECKED_CELLS)
def test_unchecked_loss_is_never_finite_over_nonfinite_gradients(fault, fn, path, backend):
    """check_finite=False raises nothing; whatever the fault, a finite loss comes with finite gradients (before:
    the triton fused loss returned 0 with NaN gradients for a NaN logit)."""
    d = dict(make())
    options = {"check_finite": False}
    if fault in ("nan_logit", "inf_logit", "overflow"):
        d["logits"], extra = faulty_logits(d, {"nan_logit": "nan", "inf_logit": "inf"}.get(fault, fault))
        d["hidden"] = d["hidden"].clone()
        d["hidden"][KEPT] = 1e38 if fault == "overflow" else LOGIT_FAULTS[fault[:3]][0]
        options.update(extra)
    elif fault == "nan_hidden":
        d = with_value(d, "hidden", KEPT, math.nan)
    elif fault == "inf_weight":
        d = with_value(d, "weight", 5, math.inf)
    else:
        name = fault.removeprefix("nan_")
        d = with_value(d, name, KEPT if name in PER_TOKEN else KEPT[0], math.nan)
    out, leaves = loss(fn, d, backend, path, **options)
    out.loss.backward()
    grads_finite = all(torch.isfinite(p.grad).all() for p in leaves if p.grad is not None)
    assert not torch.isfinite(out.loss) or grads_finite, (out.loss, grads_finite)
    if fault in ("nan_logit", "nan_hidden"):
        assert torch.isnan(out.loss)


def test_check_finite_is_on_by_default_everywhere():
    for fn in (gk.token_logprobs, gk.fused_linear_token_logprobs, gk.grpo_loss, gk.fused_linear_grpo_loss):
        assert inspect.signature(fn).parameters["check_finite"].default is True, fn.__name__
    assert inspect.signature(gk.GRPOLoss).parameters["check_finite"].default is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_finite_false_skips_the_checks(backend):
    d = with_value(make(), "advantages", 1, math.nan)
    logits, _ = faulty_logits(d, "nan")
    args = (d["targets"], d["advantages"], d["old_logp"], d["ref_logp"], d["mask"])
    for check in (gk.GRPOLoss(beta=0.04, backend=backend), lambda *a: gk.grpo_loss(*a, beta=0.04, backend=backend)):
        with pytest.raises(ValueError, match="advantages must be finite"):
            check(logits.clone(), *args)
    module = gk.GRPOLoss(beta=0.04, backend=backend, check_finite=False)
    assert torch.isnan(module(logits.clone(), *args).loss)
    assert torch.isnan(gk.grpo_loss(logits.clone(), *args, beta=0.04, backend=backend, check_finite=False).loss)
    logp = gk.token_logprobs(logits, d["targets"], mask=d["mask"], backend=backend, check_finite=False)
    others = d["mask"].clone()
    others[KEPT] = False
    assert torch.isnan(logp[KEPT]) and torch.isfinite(logp[others]).all()
    p = with_value(d, "hidden", KEPT, math.nan)
    logp = gk.fused_linear_token_logprobs(
        p["hidden"], d["weight"], d["targets"], bias=d["bias"], mask=d["mask"], backend=backend, check_finite=False
    )
    assert torch.isnan(logp[KEPT])


# The in-place contract: the backward leaves dL/dlogits in the logits' buffer.


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
def test_a_second_call_on_consumed_logits_raises(path, backend):
    """A second call on logits an in-place backward overwrote is refused: it would read the gradient as logits
    (`ratio/mean` 1.03 where 1.0 is right)."""
    d = make()
    args = (d["targets"], d["advantages"], d["old_logp"], d["ref_logp"], d["mask"])
    logits = d["logits"].clone().requires_grad_()
    gk.grpo_loss(logits, *args, backend=backend, **PATHS[path]).loss.backward()
    match = "logits hold the gradient an earlier in-place backward wrote into them"
    with pytest.raises(ValueError, match=match):
        gk.grpo_loss(logits, *args, backend=backend, **PATHS[path])
    with pytest.raises(ValueError, match=match):  # a detached alias shares the buffer and its version counter
        gk.token_logprobs(logits.detach(), d["targets"], backend=backend)
    with pytest.raises(ValueError, match=match):
        gk.GRPOLoss(backend=backend, **PATHS[path])(logits, *args)
    with torch.no_grad():  # new values in the buffer: a fresh forward
        logits.copy_(d["logits"])
    first = gk.grpo_loss(logits, *args, backend=backend, **PATHS[path])
    fresh = d["logits"].clone().requires_grad_()  # a gradient taken as above: the same route
    kept = gk.grpo_loss(fresh, *args, backend=backend, inplace=False, **PATHS[path])
    assert torch.equal(first.loss, kept.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_false_keeps_the_logits(backend):
    d = make()
    logits = d["logits"].clone().requires_grad_()
    args = (d["targets"], d["advantages"], None, None, d["mask"])
    out = gk.grpo_loss(logits, *args, backend=backend, inplace=False)
    out.loss.backward()
    again = gk.grpo_loss(logits, *args, backend=backend, inplace=False)
    assert torch.equal(logits, d["logits"]) and again.metrics["ratio/mean"] == out.metrics["ratio/mean"] == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_of_a_consumed_buffer_raise_and_disjoint_micro_batches_do_not(backend):
    """A causal LM's `logits[:, :-1]` taken again is the same consumed buffer; micro-batches sliced from one
    logits buffer are disjoint, so consuming one leaves the others usable."""
    d = make()
    full = torch.cat([d["logits"], d["logits"][:, :1]], 1).requires_grad_()  # [B, T + 1, V]
    gk.token_logprobs(full[:, :-1], d["targets"], mask=d["mask"], backend=backend).sum().backward()
    with pytest.raises(ValueError, match="in-place backward"):
        gk.token_logprobs(full[:, :-1], d["targets"], mask=d["mask"], backend=backend)

    buffer = torch.cat([d["logits"], d["logits"]]).requires_grad_()  # [2B, T, V]: two micro-batches
    mask = d["mask"]
    gk.token_logprobs(buffer[:B], d["targets"], mask=mask, backend=backend).sum().backward()
    second = gk.token_logprobs(buffer[B:], d["targets"], mask=mask, backend=backend)
    expected = gk.token_logprobs(d["logits"], d["targets"], mask=mask, backend=backend)
    assert torch.equal(second, expected)
    with pytest.raises(ValueError, match="in-place backward"):
        gk.token_logprobs(buffer[:B], d["targets"], mask=mask, backend=backend)

"""The Triton backend's launches as `torch.library` ops, each with a fake (output shapes and dtypes only), and
the backend's protocol functions over them (`protocol.VOCAB_PASS`, `protocol.EPILOGUE`; the lean tiles in `lean.py`).

Under `torch.compile` each launch is one opaque node of the graph instead of host code to trace (the launchers read
data pointers, the interpreter runs numpy), so a loss call compiles whole and a CUDA graph can replay it. The ops are
forward-only or backward-only: the autograd lives in the backend-neutral drivers (`logits_driver.py`,
`fused_linear*.py`), which call the functions below. An op that writes into a caller's buffer says so in `mutates_args`:
the backward into `out`, or into the logits themselves (`token_logprobs_bwd_inplace`, chosen when `out` is the logits).
Outputs a call did not ask for (the entropy, a statistic) come back as empty tensors, as an op returns tensors only.

The launchers themselves stay plain functions (`token_logprobs.py`, `grpo_loss.py`): `benchmarks.static_report`
records their launches on meta tensors, where these ops would run their fakes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
import triton
from torch import Tensor

from grpo_kernels.kernels.protocol import LossSides, RowGrads, VocabPassArgs, epilogue_fields, writes_in_place
from grpo_kernels.kernels.triton import grpo_loss as loss_launch
from grpo_kernels.kernels.triton import token_logprobs as launch

STATS = launch._STATS  # the optional statistics, in the ops' output order (`protocol.TOKEN_STATS`)
KL_KINDS = loss_launch.KL_KINDS  # the estimators the epilogue implements (the record's `epilogue_kl`)


NAMESPACE = "grpo_kernels_triton"
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
OPS: dict[str, torch._ops.OpOverload] = {}  # name -> the op, torch.ops.grpo_kernels_triton.<name>.default


def _op(mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], torch._ops.OpOverload]:
    """Define the op `NAMESPACE::<name>` from a typed function `_<name>` (its schema inferred from the annotations,
    `mutates_args` marked written) and implement it with that function on every device. A plain `Library` op, not
    `torch.library.custom_op`, whose Python autograd and version-counter layers cost the host time this backend
    saves: a trivial op took 40 µs a call as a custom_op, 11 µs as a `Library` op, 6 µs as a plain function (the
    2-core CPU, torch 2.13). The drivers call the ops with gradients off, and bump the version of logits written in
    place themselves (`logits_driver.in_place_or_new`)."""

    def define(fn: Callable) -> torch._ops.OpOverload:
        name = fn.__name__.lstrip("_")
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        OPS[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
        return OPS[name]

    return define


def _fake(op: torch._ops.OpOverload) -> Callable[[Callable], Callable]:
    """Register the decorated function as `op`'s fake: output shapes and dtypes from the inputs', nothing computed."""
    return lambda fn: torch.library.register_fake(op, fn, lib=_LIBRARY)


def _row(like: Tensor, rows: tuple[int, ...], asked: bool = True, dtype: torch.dtype = torch.float32) -> Tensor:
    """A per-row output of shape `rows`, or an empty one where it was not asked for."""
    return like.new_empty(rows if asked else (0,), dtype=dtype)


def _pass_outputs(like: Tensor, rows: tuple[int, ...], with_entropy: bool, *stats: bool) -> tuple[Tensor, ...]:
    """A pass's outputs, empty, as its fake gives them: logp, lse, entropy, then each of `STATS` (is_top1 bool)."""
    asked = dict(zip(STATS, stats, strict=True))
    values = (_row(like, rows, on, torch.bool if name == "is_top1" else torch.float32) for name, on in asked.items())
    return _row(like, rows), _row(like, rows), _row(like, rows, with_entropy), *values


def _asked(values: list[Tensor], stats: tuple[str, ...]) -> dict[str, Tensor]:
    """The statistics a call asked for, by name, from an op's outputs for all of `STATS`."""
    return {name: value for name, value in zip(STATS, values, strict=True) if name in stats}


def _softcap(softcap: float | None) -> float | None:
    return None if softcap is None else float(softcap)


# --- the vocabulary pass ---------------------------------------------------------------------------------------------


@_op()
def _token_logprobs_fwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    temperature: float,
    with_entropy: bool,
    logit_scale: float,
    softcap: float | None,
    log_sum_sq_probs: bool,
    mean_logits: bool,
    is_top1: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    asked = dict(zip(STATS, (log_sum_sq_probs, mean_logits, is_top1), strict=True))
    stats = tuple(name for name, on in asked.items() if on)
    logp, lse, entropy, out = launch.token_logprobs_fwd(
        VocabPassArgs(logits=logits, targets=targets, mask=mask, temperature=temperature, logit_scale=logit_scale,
                      softcap=softcap, with_entropy=with_entropy, stats=stats)
    )  # fmt: skip
    entropy = _row(logp, (0,)) if entropy is None else entropy
    return logp, lse, entropy, *(out[name] if name in out else _row(logp, (0,)) for name in STATS)


@_fake(_token_logprobs_fwd)
def _(logits, targets, mask, temperature, with_entropy, logit_scale, softcap, log_sum_sq_probs, mean_logits, is_top1):
    return _pass_outputs(logits, tuple(logits.shape[:2]), with_entropy, log_sum_sq_probs, mean_logits, is_top1)


def _flat_pass(args: VocabPassArgs) -> tuple:
    """A pass's record as the ops take it (their schema has no records): logits, targets, mask, temperature,
    with_entropy, logit_scale, softcap, then one flag per `STATS`."""
    return (
        args.logits, args.targets, args.mask, float(args.temperature), bool(args.with_entropy),
        float(args.logit_scale), _softcap(args.softcap), *(name in args.stats for name in STATS),
    )  # fmt: skip


def token_logprobs_fwd(args: VocabPassArgs) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """`protocol.VocabPass.token_logprobs_fwd` as one op: logits (last stride 1) -> logp, lse, entropy|None,
    [B, T] float32, and the asked `stats` by name."""
    logp, lse, entropy, *values = _token_logprobs_fwd(*_flat_pass(args))
    return logp, lse, entropy if args.with_entropy else None, _asked(values, args.stats)


@_op(mutates_args=("out",))
def _token_logprobs_bwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    out: Tensor,
) -> None:
    launch.token_logprobs_bwd(
        VocabPassArgs(logits=logits, targets=targets, mask=mask, temperature=temperature, logit_scale=logit_scale,
                      softcap=softcap),
        RowGrads(lse=lse, entropy=entropy, grad_logp=grad_logp, grad_entropy=grad_entropy),
        out,
    )  # fmt: skip


@_fake(_token_logprobs_bwd)
def _(logits, targets, mask, lse, entropy, grad_logp, grad_entropy, temperature, logit_scale, softcap, out):
    return None


@_op(mutates_args=("logits",))
def _token_logprobs_bwd_inplace(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
) -> None:
    launch.token_logprobs_bwd(
        VocabPassArgs(logits=logits, targets=targets, mask=mask, temperature=temperature, logit_scale=logit_scale,
                      softcap=softcap),
        RowGrads(lse=lse, entropy=entropy, grad_logp=grad_logp, grad_entropy=grad_entropy),
        logits,
    )  # fmt: skip


@_fake(_token_logprobs_bwd_inplace)
def _(logits, targets, mask, lse, entropy, grad_logp, grad_entropy, temperature, logit_scale, softcap):
    return None


def token_logprobs_bwd(args: VocabPassArgs, grads: RowGrads, out: Tensor) -> None:
    """`protocol.VocabPass.token_logprobs_bwd` as one op: dL/dlogits into `out`, which may be the logits (then the
    op that declares the logits mutated)."""
    rows = (args.targets, args.mask, grads.lse, grads.entropy, grads.grad_logp, grads.grad_entropy)
    transform = (float(args.temperature), float(args.logit_scale), _softcap(args.softcap))
    if writes_in_place(out, args.logits):
        _token_logprobs_bwd_inplace(args.logits, *rows, *transform)
    else:
        _token_logprobs_bwd(args.logits, *rows, *transform, out)


# --- the fused loss epilogue -----------------------------------------------------------------------------------------


@_op()
def _grpo_loss_fwd(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    weights: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_ratio: Tensor | None,
    policy: str,
    eps_low: float,
    eps_high: float,
    delta: float | None,
    clip_ratio_c: float | None,
    cispo_two_sided: bool,
    beta: float,
    kl_estimator: str,
    bias_correction: bool,
    tau_pos: float,
    tau_neg: float,
    temperature: float,
    with_entropy: bool,
    logit_scale: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    epilogue = SimpleNamespace(
        kind=policy, eps_low=eps_low, eps_high=eps_high, delta=delta, clip_ratio_c=clip_ratio_c,
        cispo_two_sided=cispo_two_sided, beta=beta, kl_estimator=kl_estimator, bias_correction=bias_correction,
        tau_pos=tau_pos, tau_neg=tau_neg,
    )  # fmt: skip
    logp, lse, entropy, loss, dlogp = loss_launch.grpo_loss_fwd(
        VocabPassArgs(logits=logits, targets=targets, mask=mask, temperature=temperature, logit_scale=logit_scale,
                      softcap=softcap, with_entropy=with_entropy),
        LossSides(weights=weights, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp, is_ratio=is_ratio),
        epilogue,
    )  # fmt: skip
    return logp, lse, _row(logp, (0,), dtype=logp.dtype) if entropy is None else entropy, loss, dlogp


@_fake(_grpo_loss_fwd)
def _(logits, targets, mask, weights, advantages, old_logp, ref_logp, is_ratio, policy, eps_low, eps_high, delta,
      clip_ratio_c, cispo_two_sided, beta, kl_estimator, bias_correction, tau_pos, tau_neg, temperature, with_entropy,
      logit_scale, softcap):  # fmt: skip
    rows, dtype = tuple(logits.shape[:2]), weights.dtype  # [B, T]
    per_row = [_row(weights, rows, dtype=dtype) for _ in range(4)]  # logp, lse, loss, dL/dlogp
    return per_row[0], per_row[1], _row(weights, rows, with_entropy, dtype), per_row[2], per_row[3]


def grpo_loss_fwd(
    args: VocabPassArgs, sides: LossSides, epilogue
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """`protocol.Epilogue.grpo_loss_fwd` as one op: logp, lse, entropy|None, weighted per-token loss, weighted
    dL/dlogp, each [B, T] float32; `epilogue` a `TokenEpilogue`, passed to the op field by field."""
    logp, lse, entropy, loss, dlogp = _grpo_loss_fwd(
        args.logits, args.targets, args.mask, sides.weights, sides.advantages, sides.old_logp, sides.ref_logp,
        sides.is_ratio, *epilogue_fields(epilogue), float(args.temperature), bool(args.with_entropy),
        float(args.logit_scale), _softcap(args.softcap),
    )  # fmt: skip
    return logp, lse, entropy if args.with_entropy else None, loss, dlogp


# --- the lean fused lm_head's tiles (`lean.py`) ----------------------------------------------------------------------


@_op()
def _token_logprobs_partials(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    temperature: float,
    with_entropy: bool,
    logit_scale: float,
    softcap: float | None,
    log_sum_sq_probs: bool,
    mean_logits: bool,
    is_top1: bool,
) -> Tensor:
    a, b = launch.transform_coefficients(temperature, logit_scale, softcap)
    stats = dict(zip(STATS, (log_sum_sq_probs, mean_logits, is_top1), strict=True))
    flags = launch._flags(with_entropy, softcap, [name for name, on in stats.items() if on])
    return launch.launch_partials(logits, targets, mask, a, b, flags, launch.vocab_plan(logits))


@_fake(_token_logprobs_partials)
def _(logits, targets, mask, temperature, with_entropy, logit_scale, softcap, log_sum_sq_probs, mean_logits, is_top1):
    B, T, _ = logits.shape
    splits = launch.vocab_plan(logits)["splits"]
    return logits.new_empty((launch.PARTIAL_FIELDS, B * T, splits), dtype=torch.float32)


def token_logprobs_partials(args: VocabPassArgs) -> Tensor:
    """The V-blocks' partial statistics [PARTIAL_FIELDS, B·T, V-blocks] of the logits (last stride 1; targets int32
    and mask contiguous) as one op: a split pass, merged by `token_logprobs_merge`."""
    return _token_logprobs_partials(*_flat_pass(args))


@_op()
def _token_logprobs_merge(
    partial: Tensor,
    mask: Tensor,
    vocab: int,
    temperature: float,
    with_entropy: bool,
    logit_scale: float,
    softcap: float | None,
    log_sum_sq_probs: bool,
    mean_logits: bool,
    is_top1: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows = (partial.shape[1],)
    asked = dict(zip(STATS, (log_sum_sq_probs, mean_logits, is_top1), strict=True))
    logp, lse, entropy = _row(partial, rows), _row(partial, rows), _row(partial, rows, with_entropy)
    out = {n: _row(partial, rows, on, torch.int8 if n == "is_top1" else torch.float32) for n, on in asked.items()}
    a, b = launch.transform_coefficients(temperature, logit_scale, softcap)
    flags = launch._flags(with_entropy, softcap, [name for name, on in asked.items() if on])
    outputs = (logp, lse, entropy if with_entropy else logp, *(out[n] if asked[n] else logp for n in STATS))
    splits = partial.shape[2]
    launch._token_logprobs_merge_kernel[rows](
        partial, mask, *outputs, splits, vocab, a, b, **flags,
        SPLITS=triton.next_power_of_2(splits), num_warps=1, enable_fp_fusion=True,
    )  # fmt: skip
    return logp, lse, entropy, out["log_sum_sq_probs"], out["mean_logits"], out["is_top1"].bool()


@_fake(_token_logprobs_merge)
def _(partial, mask, vocab, temperature, with_entropy, logit_scale, softcap, log_sum_sq_probs, mean_logits, is_top1):
    return _pass_outputs(partial, (partial.shape[1],), with_entropy, log_sum_sq_probs, mean_logits, is_top1)


def token_logprobs_merge(
    partial: Tensor,
    mask: Tensor,
    vocab: int,
    temperature: float,
    with_entropy: bool,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    stats: tuple[str, ...] = (),
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """(logp, lse, entropy or None, {stat: [rows]}) of rows from all their V-blocks' partial statistics [PARTIAL_FIELDS,
    rows, V-blocks] over a vocabulary of `vocab` columns, as one op; masked rows 0 (False)."""
    logp, lse, entropy, *values = _token_logprobs_merge(
        partial, mask, int(vocab), float(temperature), bool(with_entropy), float(logit_scale), _softcap(softcap),
        *(name in stats for name in STATS),
    )  # fmt: skip
    return logp, lse, entropy if with_entropy else None, _asked(values, stats)

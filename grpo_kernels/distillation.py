"""On-policy distillation's loss from both models' hidden states: `fused_linear_divergence` and its module.

The student's and the teacher's lm_heads and the divergence run in one chunked pass (`kernels/divergence.py`), so
neither model's `[N, V]` logits exist beyond one chunk of rows. Argument names, the divergences (`beta`: 0 forward KL,
1 reverse KL, else generalized JSD), the per-head transforms and the reduction are TRL 1.16's
(`DistillationTrainer`, `_chunked_divergence_loss`); `grpo_kernels.reference_divergence` is the float64 oracle and
`docs/distillation.md` the guide.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_kernels.kernels import backend as backends
from grpo_kernels.kernels.divergence import MEMORY_MODES, SUPPORT, DivergenceOptions, fused_linear_divergence_rows
from grpo_kernels.kernels.torch.divergence import Head
from grpo_kernels.tensor_checks import check_tensor, raise_first

CHUNK_BYTES = 64 * 2**20  # each of the two [rows, V] logits buffers, when chunk_size is not given
# the CPU's: its GEMMs stream all of both weights (and dW) once per chunk, so they want a few hundred rows; reverse
# KL, N 2,048, H 896, V 151,936, fp32, forward + backward: 17.9 s at 128 rows a chunk, 16.3 s at 256, 15.1 s at 512
CPU_CHUNK_BYTES = 256 * 2**20
BACKENDS = ("auto", *SUPPORT)


@dataclass
class DivergenceOutput:
    """`loss`: Σ of the kept tokens' divergence / `num_items_in_batch` (or / `num_valid`), differentiable in the
    student's hidden, weight and bias. Per token, shaped like the mask (`[B, T]` or `[N]`), 0 at dropped tokens,
    detached: `divergence`, the student's `entropy`, its `logp` of `targets` (None without targets); `topk_ids`
    `[..., k]` with top_k (0 at dropped tokens); `num_valid`: the kept-token count (a tensor)."""

    loss: Tensor
    divergence: Tensor
    entropy: Tensor
    logp: Tensor | None
    topk_ids: Tensor | None
    num_valid: Tensor


def divergence_options(
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    top_k: int = 0,
) -> DivergenceOptions:
    """The two-head pass's options from `fused_linear_divergence`'s keywords of the same names and defaults, checked
    (top_k < V is checked where V is known, with the tensors)."""
    if not isinstance(beta, int | float) or isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta!r}")
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite, got {temperature!r}")
    for name, scale in (("student_logit_scale", student_logit_scale), ("teacher_logit_scale", teacher_logit_scale)):
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale):
            raise ValueError(f"{name} must be a finite number, got {scale!r}")
    for name, cap in (("student_final_logit_softcapping", student_final_logit_softcapping),
                      ("teacher_final_logit_softcapping", teacher_final_logit_softcapping)):  # fmt: skip
        if cap is not None and (not isinstance(cap, int | float) or isinstance(cap, bool) or not 0 < cap < math.inf):
            raise ValueError(f"{name} must be None or > 0, got {cap!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    return DivergenceOptions(
        beta=float(beta),
        temperature=float(temperature),
        student=Head(float(student_logit_scale), _float_or_none(student_final_logit_softcapping)),
        teacher=Head(float(teacher_logit_scale), _float_or_none(teacher_final_logit_softcapping)),
        top_k=top_k,
        backend="torch",
    )


def _float_or_none(x: float | None) -> float | None:
    return None if x is None else float(x)


TEACHER_OPTIONS = ("beta", "temperature", "teacher_logit_scale", "teacher_final_logit_softcapping", "top_k")


def as_teacher_divergence(value: DivergenceOptions | Mapping | None) -> DivergenceOptions | None:
    """`LossOptions.teacher_divergence` as the pass's record: None (`divergence_options`' defaults when the term is
    on), a DivergenceOptions, or a mapping of `TEACHER_OPTIONS` (`fused_linear_divergence`'s names). The student's
    head transform is the loss's own `logit_scale` / `final_logit_softcapping`, so the mapping has none."""
    if value is None:
        return None
    if isinstance(value, DivergenceOptions):
        if value.student != Head():
            raise ValueError("teacher_divergence: the student's head transform is the loss's logit_scale / "
                             f"final_logit_softcapping, got student={value.student}")  # fmt: skip
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"teacher_divergence must be a mapping of {list(TEACHER_OPTIONS)} or None, got "
                        f"{type(value).__name__}")  # fmt: skip
    unknown = sorted(map(str, set(value) - set(TEACHER_OPTIONS)))
    if unknown:
        raise TypeError(f"teacher_divergence: unknown option {unknown[0]!r}; valid: {list(TEACHER_OPTIONS)}")
    try:
        return divergence_options(**value)
    except ValueError as error:
        raise ValueError(f"teacher_divergence: {error}") from None


def teacher_divergence_fields(opts: DivergenceOptions) -> dict:
    """`as_teacher_divergence`'s mapping of a record (plain data: a config file's)."""
    return {"beta": opts.beta, "temperature": opts.temperature, "teacher_logit_scale": opts.teacher.logit_scale,
            "teacher_final_logit_softcapping": opts.teacher.final_logit_softcapping, "top_k": opts.top_k}  # fmt: skip


def fused_linear_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    beta: float = 1.0,
    temperature: float = 1.0,
    num_items_in_batch: Tensor | float | None = None,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    top_k: int = 0,
    topk_ids: Tensor | None = None,
    chunk_size: int | None = None,
    memory: str = "auto",
    backend: str = "auto",
    check_finite: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> DivergenceOutput:
    """The distillation divergence between a student and a teacher over the same vocabulary, from their hidden states.

    Arguments:
        student_hidden: `[B, T, H_s]` or packed `[N, H_s]`; student_weight: its lm_head `[V, H_s]` (bf16, fp16, fp32,
            float64; student_bias `[V]`). teacher_hidden / teacher_weight / teacher_bias: the same for the teacher,
            `H_t` its own width; the teacher gets no gradient.
        mask: bool or 0/1 `[B, T]` / `[N]` (TRL's completion mask; None: every token). Dropped tokens are never
            projected. Packed sequences are rows of the `[N, H]` form.
        targets: the sampled token ids `[B, T]` / `[N]`, for the student's log-prob of each (optional).
        beta: 0.0 forward KL(teacher || student), 1.0 reverse KL(student || teacher) (TRL's default), else the
            generalized JSD with mixture (1 − beta)·p_student + beta·p_teacher.
        temperature: divides both heads' logits after each head's `*_logit_scale` and `*_final_logit_softcapping`.
        num_items_in_batch: the loss is Σ over kept tokens / num_items_in_batch (TRL's rule: the global count over
            ranks and accumulation steps, divided by the process count by the caller); None: / the kept count.
        top_k: > 0 compares the heads over the teacher's k ids plus one tail bucket with the rest of the mass;
            `topk_ids` `[B, T, k]` / `[N, k]` gives the ids (distinct per token), else the teacher's top k are taken.
        chunk_size: rows per chunk (default: two float32 `[rows, V]` buffers of 64 MiB each, 256 MiB each on the
            CPU, whose GEMMs want a few hundred rows). memory: "auto" or
            "fast" (row chunks), or "lean" (tiles of rows × vocabulary columns, `chunk_size` rows at most: no
            `[rows, V]` buffer and, for bf16/fp16 heads, no float32 `[V, H]` one, for 8 GEMMs instead of 4; torch
            backend, no top_k). backend: "auto" (Triton on CUDA where it runs the call, else
            torch), "torch" or "triton" (float64 refused on it, reason given; "cuda": refused).
            process_group / vocab_start (vocabulary-parallel heads): refused.
        check_finite: a kept token whose student or teacher log-sum-exp is not finite is a ValueError naming it
            (one host sync).

    Return: `DivergenceOutput`.
    """
    _check_route(backend, memory, process_group, vocab_start)
    for name, x in (("student_hidden", student_hidden), ("student_weight", student_weight),
                    ("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):  # fmt: skip
        check_float(name, x)
    lead, V = student_hidden.shape[:-1], student_weight.shape[0]
    check_heads(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
    kept = _kept_rows(mask, lead, student_hidden.device)  # [M] row indices
    rows_targets = _rows_of("targets", targets, lead, kept, V)
    rows_ids = _checked_topk(top_k, topk_ids, lead, kept, V)
    opts = divergence_options(
        beta=beta,
        temperature=temperature,
        student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        student_final_logit_softcapping=student_final_logit_softcapping,
        teacher_final_logit_softcapping=teacher_final_logit_softcapping,
        top_k=top_k,
    )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    memory = "fast" if memory == "auto" else memory
    opts = dataclasses.replace(
        opts,
        chunk_size=chunk_size or max(1, _chunk_bytes(student_hidden.device) // (4 * V)),
        backend=_resolved(backend, top_k, student_weight.dtype, student_hidden.device, memory),
        memory=memory,
        tile=(chunk_size, None),
    )
    s_rows = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, kept)  # [M, H_s]
    t_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, kept)  # [M, H_t]
    total, details = fused_linear_divergence_rows(
        (s_rows, student_weight, student_bias), (t_rows, teacher_weight, teacher_bias), rows_targets, rows_ids, opts
    )
    if check_finite:
        check_rows(details["lse_s"], "student", kept, lead)
        check_rows(details["lse_t"], "teacher", kept, lead)
    num_valid = torch.tensor(kept.numel(), device=student_hidden.device)
    denominator = num_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = total / (denominator.to(total.device) if isinstance(denominator, Tensor) else denominator)
    scatter = lambda x: _scatter(x, kept, lead)  # noqa: E731
    return DivergenceOutput(
        loss=loss,
        divergence=scatter(details["divergence"]),
        entropy=scatter(details["entropy"]),
        logp=scatter(details["logp"]) if "logp" in details else None,
        topk_ids=scatter(details["topk_ids"]) if "topk_ids" in details else None,
        num_valid=num_valid,
    )


class FusedLinearDivergence(nn.Module):
    """`FusedLinearDivergence(beta=0.5, temperature=0.9)(student_hidden, student_weight, teacher_hidden,
    teacher_weight, mask=..., num_items_in_batch=...)`: `fused_linear_divergence` with its options held once (the
    keyword arguments of the constructor); those of the call are the per-batch tensors."""

    def __init__(self, **options):
        super().__init__()
        per_batch = {"mask", "targets", "num_items_in_batch", "student_bias", "teacher_bias", "topk_ids"}
        wrong = sorted(set(options) & per_batch)
        if wrong:
            raise TypeError(f"{wrong[0]} is a per-batch tensor: pass it to the call, not to FusedLinearDivergence()")
        self.options = options

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, **tensors) -> DivergenceOutput:
        return fused_linear_divergence(
            student_hidden, student_weight, teacher_hidden, teacher_weight, **self.options, **tensors
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


def _check_route(backend, memory, process_group, vocab_start) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto" and not SUPPORT[backend].runs:
        raise ValueError(f"backend={backend!r}: {SUPPORT[backend].why_not}")
    if memory not in ("auto", *MEMORY_MODES):
        raise ValueError(f"memory must be one of {('auto', *MEMORY_MODES)}, got {memory!r}")
    if process_group is not None or vocab_start is not None:
        raise ValueError(
            "process_group / vocab_start: vocabulary-parallel heads are not supported by the two-head divergence "
            "(each rank would need both heads' O(N) statistics merged, and the JSD a second pass); gather the heads"
        )


def _resolved(backend: str, top_k: int, dtype: torch.dtype, device: torch.device, memory: str) -> str:
    """The backend that runs the call: "auto" is Triton on CUDA where its record claims the call, else torch; a
    backend that refuses the call, or cannot run on `device`, is a ValueError saying why."""
    if backend == "auto":
        claimed = device.type == "cuda" and not SUPPORT["triton"].refusal(top_k, dtype, memory)
        backend = "triton" if claimed and backends.CAPABILITIES["triton"].usable(device)[0] else "torch"
    why = SUPPORT[backend].refusal(top_k, dtype, memory)
    if not why:
        usable, why = backends.CAPABILITIES[backend].usable(device)
        why = "" if usable else why
    if why:
        raise ValueError(f"backend={backend!r}: {why}")
    return backend


def check_float(name: str, x: object) -> None:
    check_tensor(name, x)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be bf16, fp16, fp32 or float64, got {x.dtype}")


def check_heads(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student: str = "student_") -> None:
    """Shapes: both hidden tensors with the same leading dims, each weight [V, its H], one V, biases [V]; the
    student's tensors named `{student}hidden`, `{student}weight`, `{student}bias`."""
    s_names = {part: f"{student}{part}" for part in ("hidden", "weight", "bias")}
    if s_hidden.dim() not in (2, 3):
        raise ValueError(f"{s_names['hidden']} must be [B, T, H] or [N, H], got {list(s_hidden.shape)}")
    if t_hidden.shape[:-1] != s_hidden.shape[:-1] or t_hidden.dim() != s_hidden.dim():
        want = list(s_hidden.shape[:-1]) + ["H_t"]
        raise ValueError(f"teacher_hidden must be {want} like {s_names['hidden']}, got {list(t_hidden.shape)}")
    for name, weight, hidden in ((s_names["weight"], s_weight, s_hidden), ("teacher_weight", t_weight, t_hidden)):
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(f"{name} must be [V, {hidden.shape[-1]}], got {list(weight.shape)}")
    V = s_weight.shape[0]
    if t_weight.shape[0] != V:
        raise ValueError(f"teacher_weight must be [V, H_t] with the student's V = {V}, got {list(t_weight.shape)}")
    for name, bias in ((s_names["bias"], s_bias), ("teacher_bias", t_bias)):
        if bias is not None and (check_tensor(name, bias).shape != (V,) or not bias.is_floating_point()):
            raise ValueError(f"{name} must be a floating-point [V] = [{V}] tensor, got {list(bias.shape)}")
    for name, x in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight), (s_names["weight"], s_weight)):
        if x.device != s_hidden.device:
            raise ValueError(f"{name} must be on {s_names['hidden']}'s device {s_hidden.device}, got {x.device}")


def _chunk_bytes(device: torch.device) -> int:
    """Each [rows, V] buffer's default budget: `CPU_CHUNK_BYTES` on the CPU (for the GEMMs' speed), else
    `CHUNK_BYTES`."""
    return CPU_CHUNK_BYTES if device.type == "cpu" else CHUNK_BYTES


def _kept_rows(mask: Tensor | None, lead: torch.Size, device: torch.device) -> Tensor:
    """The flattened indices of the kept tokens, int64 `[M]` (one host sync: M sizes the pass)."""
    if mask is None:
        return torch.arange(lead.numel(), device=device)
    check_tensor("mask", mask)
    if mask.shape != lead:
        raise ValueError(f"mask must be {list(lead)} like the hidden states' leading dims, got {list(mask.shape)}")
    if mask.dtype != torch.bool:
        raise_first("mask", mask, (mask != 0) & (mask != 1), "hold only 0 and 1")
    return mask.reshape(-1).nonzero()[:, 0].to(device)


def _rows_of(name: str, ids: Tensor | None, lead: torch.Size, kept: Tensor, V: int) -> Tensor | None:
    """The kept rows of token ids `[*lead]`, checked in [0, V) there."""
    if ids is None:
        return None
    check_tensor(name, ids)
    if ids.shape != lead or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer {list(lead)}, got {ids.dtype} {list(ids.shape)}")
    rows = ids.reshape(-1).index_select(0, kept.to(ids.device)).long().to(kept.device)
    raise_first(name, rows, (rows < 0) | (rows >= V), f"be in [0, {V}) at kept tokens")
    return rows


def _checked_topk(top_k: int, topk_ids: Tensor | None, lead: torch.Size, kept: Tensor, V: int) -> Tensor | None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k < V:
        raise ValueError(f"top_k must be an int in [0, V) = [0, {V}), got {top_k!r}")
    if topk_ids is None:
        return None
    check_tensor("topk_ids", topk_ids)
    if top_k == 0 or topk_ids.shape != (*lead, top_k) or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be integer {[*lead, top_k or 'k']} with top_k = k > 0, got "
                         f"{list(topk_ids.shape)} with top_k = {top_k}")  # fmt: skip
    rows = topk_ids.reshape(-1, top_k).index_select(0, kept.to(topk_ids.device)).long().to(kept.device)
    raise_first("topk_ids", rows, (rows < 0) | (rows >= V), f"be in [0, {V}) at kept tokens")
    ordered = rows.sort(-1).values
    raise_first("topk_ids", ordered[:, 1:], ordered[:, 1:] == ordered[:, :-1], "hold distinct ids per token")
    return rows


def check_rows(lse: Tensor, head: str, kept: Tensor, lead: torch.Size) -> None:
    """ValueError naming the first kept token (`kept` [M]: the rows' flattened token indices) whose `head`'s
    ("student" or "teacher") log-sum-exp `lse` [M] is not finite."""
    bad = ~torch.isfinite(lse)
    if bad.any():
        flat = int(kept[bad.nonzero()[0, 0]])
        where = flat if len(lead) == 1 else tuple(divmod(flat, lead[-1]))
        raise ValueError(f"{head}_hidden: the {head} head's logits at token {where} have no finite log-sum-exp "
                         f"(NaN or ±inf logits)")  # fmt: skip


def _scatter(values: Tensor, kept: Tensor, lead: torch.Size) -> Tensor:
    """Per-row values `[M, ...]` back to `[*lead, ...]`, 0 at dropped tokens."""
    out = values.new_zeros((lead.numel(), *values.shape[1:]))
    out.index_copy_(0, kept, values)
    return out.reshape(*lead, *values.shape[1:])

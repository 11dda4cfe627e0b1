"""PolicyModule: a causal LM with the fused lm_head + GRPO loss inside its `forward`.

The loss's lm_head matmul runs in `forward`, so DDP's gradient hooks and FSDP2's parameter gathering see it like any
other layer: the module DDP or FSDP2 wraps is this one, not the bare model. `logprobs` (old-policy and reference
log-probs, forward only) and `generate` (rollouts) are the other two entry points; under FSDP2 they are registered
as forward methods, so the sharded parameters are gathered for them too.
With `padding_free` every pass packs its rows (`PackedSequences`): the decoder and the lm_head see each sequence's
real tokens only, the loss takes the packed layout; the records around it (`UpdateBatch`, the log-probs it
returns) keep the padded `[B, T]` layout the rest of the trainer uses.

`own_pass_loss`, the update pass as its own log-prob pass: where π_old is π_θ at the update (μ = 1, one optimizer
step per generation), π_old is the update pass's own log-probs, detached, and the separate no-grad π_old pass does
not run.

A token-level loss without a rollout correction (`fuses_own_pass`) runs the fused loss itself with old_logp None
(`fused_linear_grpo_loss`'s 3-GEMM route): each chunk's log-probs, detached, are π_old, and the sampler correction's
ratio π_old / π_sampler is formed from them inside the loss (a per-sequence ratio whose micro-batch takes several
chunks of rows: from a no-grad pass of the head first, 1 GEMM, no decoder forward). Every other loss and option runs
the fused lm_head's log-probs with gradients (`fused_linear_token_logprobs`: 4 GEMMs), then the loss algebra of
`losses/` on them (`build_terms`, `compute_loss`, the `two_phase` route's), with the ratio and the rollout
correction formed from the same log-probs first. Either way the log-probs, the kept mass and the ratio go back to
the trainer (detached) for the sampler-sync guard and the `sampling/*` metrics, which it checks before the optimizer
step, and they equal a π_old pass's over the same micro-batches bitwise. With a given `old_logp` (verl's bypass
mode: the sampler's log-probs) the pass is the same, its log-probs only reported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from grpo_kernels.api import fused_linear_grpo_loss
from grpo_kernels.engine.routes import replay_metrics
from grpo_kernels.integrations.hf import completion_hidden_states, lm_head, logit_transform, policy_logprobs
from grpo_kernels.losses.epilogue import is_token_level
from grpo_kernels.losses.loss import compute_loss
from grpo_kernels.losses.mismatch import apply_rollout_correction
from grpo_kernels.losses.terms import build_terms
from grpo_kernels.options import LossOptions
from grpo_kernels.packing import PackedSequences
from grpo_kernels.trainer import sampling_replay

if TYPE_CHECKING:
    from grpo_kernels.losses.sampler_ratio import SamplerCorrection
    from grpo_kernels.trainer.teacher import Teacher


@dataclass(frozen=True, kw_only=True)
class UpdateBatch:
    """The tensors of one (micro-)batch of the update; row i is one completion with its prompt. Built by keyword
    only: three of its fields are float [B, T] tensors, which a positional swap would pass silently."""

    input_ids: Tensor  # [B, P + T] prompt ‖ completion
    attention_mask: Tensor  # [B, P + T]
    completion_mask: Tensor  # [B, T] bool
    advantages: Tensor  # [B] or [B, T]
    old_logp: Tensor | None  # [B, T]; None: the update pass's own log-probs, detached (`policy.own_pass_loss`)
    ref_logp: Tensor | None = None  # [B, T]
    is_ratio: Tensor | None = None  # [B, T] or [B]
    token_weights: Tensor | None = None  # [B, T]
    sequence_weights: Tensor | None = None  # [B]
    sampling_logp: Tensor | None = None  # [B, T] the sampler's log-probs: for LossOptions.rollout_correction, and
    # for the sampler correction of the update pass's own π_old (`policy.own_pass_loss`)

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, -self.completion_mask.shape[1] :]  # [B, T]

    def rows(self, index: Tensor) -> UpdateBatch:
        """The micro-batch of rows `index` (a 1-D long tensor)."""
        return UpdateBatch(**{name: None if value is None else value[index] for name, value in vars(self).items()})

    def token_costs(self, padding_free: bool) -> list[int]:
        """Tokens the policy's forward runs per row (`token_costs`)."""
        return token_costs(self.attention_mask, padding_free)


def token_costs(attention_mask: Tensor, padding_free: bool) -> list[int]:
    """Tokens the policy's forward runs per row of `attention_mask` [B, P + T]: its real tokens when padding-free,
    else the padded width."""
    if padding_free:
        return attention_mask.sum(1).tolist()
    return [attention_mask.shape[1]] * attention_mask.shape[0]


def token_budget_groups(costs: list[int], max_tokens: int, parts: int = 1) -> list[list[int]]:
    """Row indices grouped into consecutive runs of at most `max_tokens` tokens (`costs[i]` for row i), then split
    further (the run with the most tokens, at its token midpoint) until there are at least `parts` runs."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    used = 0
    for row, cost in enumerate(costs):
        if cost > max_tokens:
            raise ValueError(f"max_tokens_per_microbatch ({max_tokens}) is below row {row}'s {cost} tokens")
        if not groups or used + cost > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(row)
        used += cost
    while len(groups) < parts:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            raise ValueError(f"{len(costs)} rows cannot make {parts} micro-batches (each must hold a row)")
        heaviest = max(splittable, key=lambda g: sum(costs[i] for i in g))
        half, cut, total = 0, 1, sum(costs[i] for i in heaviest)
        while cut < len(heaviest) - 1 and half + costs[heaviest[cut - 1]] < total / 2:
            half += costs[heaviest[cut - 1]]
            cut += 1
        at = groups.index(heaviest)
        groups[at : at + 1] = [heaviest[:cut], heaviest[cut:]]
    return groups


class PolicyModule(nn.Module):
    """The policy (`model`, a Hugging Face `*ForCausalLM`) with its GRPO loss, log-prob and sampling entry points."""

    def __init__(self, model: nn.Module, padding_free: bool = False) -> None:
        super().__init__()
        self.model = model
        self.padding_free = padding_free
        self.teacher: Teacher | None = None  # on-policy distillation's (`trainer/teacher.py`): not a submodule

    def fused_loss(
        self, batch: UpdateBatch, options: LossOptions, correction: SamplerCorrection | None = None
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """(loss, metrics, the pass's detached log-probs {"logp", and with replay "log_kept_mass", ...}, [B, T]
        each) of the fused loss on `batch`: its π_old given (`batch.old_logp`), or None: the pass's own, detached.
        `correction`: TRL's sampler correction formed inside the loss from π_old and `batch.sampling_logp`."""
        weight, bias = lm_head(self.model)
        scale, softcap = logit_transform(self.model)
        options = dataclasses.replace(options, logit_scale=scale, final_logit_softcapping=softcap)
        mask = batch.completion_mask
        bypass = options.rollout_correction is not None and options.rollout_correction.bypass_mode
        old_logp = None if bypass else batch.old_logp  # bypass: π_old is the sampler's
        packed = checked_pack(batch.input_ids, batch.attention_mask, mask) if self.padding_free else None
        teacher = {}
        if self.teacher is not None and options.teacher_kl_coef != 0.0:
            options = self.teacher.options(options)
            teacher = self.teacher.inputs(batch.input_ids, batch.attention_mask, mask.shape[1], packed)
        corrected = options.rollout_correction is not None or correction is not None
        sampling_logp = batch.sampling_logp if corrected else None
        keywords = dict(
            bias=bias,
            sampler_correction=correction,
            return_logprobs=True,
            with_entropy=True,
            options=options,
            **teacher,
        )
        if not self.padding_free:
            hidden = completion_hidden_states(self.model, batch.input_ids, batch.attention_mask, mask.shape[1])
            out, logprobs = fused_linear_grpo_loss(
                hidden,  # [B, T, H]
                weight,
                batch.targets,
                batch.advantages,
                old_logp,
                batch.ref_logp,
                mask,
                is_ratio=batch.is_ratio,
                sampling_logp=sampling_logp,
                token_weights=batch.token_weights,
                sequence_weights=batch.sequence_weights,
                **keywords,
            )
            return out.loss, out.metrics, logprobs
        if options.loss_scale_factor is None:  # seq-mean-token-sum-norm's T: the padded width, not the packed max
            keywords["options"] = dataclasses.replace(options, loss_scale_factor=float(mask.shape[1]))
        out, logprobs = fused_linear_grpo_loss(
            completion_hidden_states(self.model, packed),  # [N, H]
            weight,
            packed.targets,
            packed.pack(batch.advantages),
            packed.pack(old_logp),
            packed.pack(batch.ref_logp),
            packed.pack(mask),
            is_ratio=packed.pack(batch.is_ratio),
            sampling_logp=packed.pack(sampling_logp),
            token_weights=packed.pack(batch.token_weights),
            sequence_weights=batch.sequence_weights,
            cu_seqlens=packed.completion_cu_seqlens,
            **keywords,
        )
        return out.loss, out.metrics, {name: packed.unpack(x) for name, x in logprobs.items()}  # [B, T] each

    def forward(
        self, batch: UpdateBatch, options: LossOptions, own_pass: OwnPass | None = None
    ) -> tuple[Tensor, dict[str, Tensor]] | tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """(loss, metrics) of the fused lm_head + GRPO loss on `batch`; the [B, T, V] logits are never stored.
        The model's own logit scaling and soft-capping (Gemma 2/3, Cohere, Granite) apply, as in `logprobs`.
        With `own_pass` the update pass is also the log-prob pass (`policy.own_pass_loss`): (loss, metrics, its detached
        log-probs, kept mass and sampler ratio)."""
        if own_pass is not None:
            return own_pass_loss(self, batch, options, own_pass)
        return self.fused_loss(batch, options)[:2]

    @torch.no_grad()
    def logprobs(self, *args, **kwargs) -> tuple[Tensor, Tensor] | dict[str, Tensor]:
        """`pass_logprobs` without gradients: the π_old and reference passes."""
        return self.pass_logprobs(*args, **kwargs)

    def pass_logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        completion_mask: Tensor,
        temperature: float,
        *,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        stats: tuple[str, ...] = (),
    ) -> tuple[Tensor, Tensor] | dict[str, Tensor]:
        """(log π(completion token), entropy), each [B, T], 0 where masked, differentiable. `top_k`, `top_p`,
        `min_p`: over the truncated sampler's support (sampling replay); `stats`: a dict of "logp", "entropy" and
        each named statistic, [B, T] (`fused_linear_token_logprobs`)."""
        options = dict(temperature=temperature, with_entropy=True, top_k=top_k, top_p=top_p, min_p=min_p, stats=stats)
        if not self.padding_free:
            return policy_logprobs(self.model, input_ids, attention_mask, completion_mask, **options)
        packed = checked_pack(input_ids, attention_mask, completion_mask)
        out = policy_logprobs(self.model, packed, **options)  # [N] each
        keep = packed.pack(completion_mask).bool()  # [N]
        named = out if stats else dict(zip(("logp", "entropy"), out, strict=True))
        padded = {name: packed.unpack(value.masked_fill(~keep, 0)) for name, value in named.items()}  # [B, T] each
        return padded if stats else (padded["logp"], padded["entropy"])

    def generate(self, *args, **kwargs):
        """`model.generate` (the rollout engine's entry point)."""
        return self.model.generate(*args, **kwargs)


def checked_pack(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> PackedSequences:
    """The rows packed; a completion token kept by `completion_mask` but not by `attention_mask` is a ValueError
    (padded, the model would not see it; packed, it would not exist)."""
    num_completion = completion_mask.shape[1]
    if input_ids.shape[1] <= num_completion:
        raise ValueError(
            f"input_ids must hold a prompt before the {num_completion} completion tokens, got {list(input_ids.shape)}"
        )
    if bool((completion_mask.bool() & ~attention_mask[:, -num_completion:].bool()).any()):
        raise ValueError("completion_mask keeps a token that attention_mask drops: they must agree to pack the rows")
    return PackedSequences.from_padded(input_ids, attention_mask, num_completion)


REPORTED = ("logp", "log_kept_mass", "is_ratio")  # what the pass reports back, detached


def fuses_own_pass(options: LossOptions) -> bool:
    """Whether the update pass as its own log-prob pass is the fused loss's (its 3-GEMM route, the sampler
    correction's ratio formed in it): a token-level loss without a rollout correction (which reads π_old over the
    whole batch); else `own_pass_loss` runs the log-probs, then the loss algebra."""
    return is_token_level(options) and options.rollout_correction is None


@dataclass(frozen=True)
class OwnPass:
    """The update pass also gives the log-probs: its own π_old where `UpdateBatch.old_logp` is None, and the sampler
    `correction`'s ratio from them (None: no correction)."""

    correction: SamplerCorrection | None = None


def own_pass_loss(
    policy: PolicyModule, batch: UpdateBatch, options: LossOptions, own_pass: OwnPass
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """(loss, metrics, the pass's detached `REPORTED` tensors, [b, T] or [b]) of one (micro-)batch: the fused
    loss's route where the loss is token level (`fuses_own_pass`), else the log-probs, then the loss algebra."""
    mask = batch.completion_mask
    if fuses_own_pass(options):
        correction = own_pass.correction if batch.old_logp is None else None
        loss, metrics, out = policy.fused_loss(batch, options, correction)
        is_ratio = batch.is_ratio if correction is None else correction.ratio(out["logp"], batch.sampling_logp, mask)
        reported = {"logp": out["logp"], "log_kept_mass": out.get("log_kept_mass"), "is_ratio": is_ratio}
        return loss, metrics, {name: x for name, x in reported.items() if x is not None}
    keywords = sampling_replay.pass_keywords(options, ("outside_support",))  # the fused loss's replay metrics too
    out = sampling_replay.named_logprobs(
        policy.pass_logprobs(batch.input_ids, batch.attention_mask, mask, options.temperature, **keywords)
    )  # [b, T] each, logp and entropy differentiable
    logp = out["logp"]
    old_logp = logp.detach() if batch.old_logp is None else batch.old_logp  # [b, T]
    is_ratio, kept, correction_metrics = batch.is_ratio, mask, None
    if own_pass.correction is not None:
        is_ratio = own_pass.correction.ratio(old_logp, batch.sampling_logp, mask)  # [b, T] or [b]
    rollout = options.rollout_correction  # the loss's own sampler correction (`losses.mismatch`)
    if rollout is not None:
        old_logp, is_ratio, kept, correction_metrics = apply_rollout_correction(
            rollout, old_logp, batch.sampling_logp, mask, logp
        )
    terms = build_terms(
        logp,
        advantages=batch.advantages,
        mask=kept,
        options=options,
        old_logp=old_logp,
        ref_logp=batch.ref_logp,
        entropy=out["entropy"],
        is_ratio=is_ratio,
        token_weights=batch.token_weights,
        sequence_weights=batch.sequence_weights,
        sampling_logp=None if rollout is None else batch.sampling_logp,
        correction_metrics=correction_metrics,
    )
    output, _ = compute_loss(terms, options)
    reported = {"logp": logp.detach(), "log_kept_mass": out.get("log_kept_mass"), "is_ratio": is_ratio}
    metrics = output.metrics | replay_metrics(out, mask)
    return output.loss, metrics, {name: x for name, x in reported.items() if x is not None}

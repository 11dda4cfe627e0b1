"""TRL's GRPOTrainer on grpo-kernels' fused lm_head + GRPO loss: a TRL script changes one import.

    from grpo_kernels.integrations.trl import GRPOTrainer    # was: from trl import GRPOTrainer
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), ...)   # TRL's constructor and config

or `patch(trainer)` for a trainer already built (a `trl.GRPOTrainer` or a subclass that keeps TRL's loss).
`GRPOConfig` here is TRL's with the fused head's `head_precision` ("auto", "bf16", "tf32", "fp32"); TRL's
`cast_lm_head_to_fp32=True` is read as "fp32".

What changes: the training loss is `fused_linear_grpo_loss` on the policy's final hidden states and lm_head weight
(token-level losses form every gradient in the forward: 3 GEMMs per chunk of tokens, no [B, T, V] logits), and the
no-grad old / reference log-prob passes are `fused_linear_token_logprobs`. What does not: TRL's generation, rewards,
advantages, batching, logging and checkpoints, and the numbers — every GRPOConfig option that shapes the loss
maps onto a `LossOptions` field with the same meaning (`_loss_options`), and the metrics keep TRL's names and
cross-process reductions. Under `top_entropy_quantile < 1` TRL's own loss algebra runs on the fused log-probs, so
that the entropy quantile is taken over every process's tokens, as TRL takes it. Truncated sampling (`top_k`,
`top_p`, `min_p`) is replayed on the policy's old and current log-probs (`trl_replay`): vLLM's importance-sampling
correction then compares log-probs over the same kept tokens.
Where stock TRL's old-log-prob pass serves only the vLLM correction and π_old is π_θ at the update, it is skipped and
the loss pass gives π_old, the correction and TRL's `sampling/*` metrics (`trl_one_pass`).

Both passes run inside the model's forward (`model(..., grpo_kernels_head=head)`, added to the policy and the
reference model), so DDP, FSDP, DeepSpeed and PEFT wrappers see an ordinary forward. The lm_head is gathered there
once per pass: FSDP2's DTensor with one `full_tensor()`, DeepSpeed ZeRO-3's partitioned parameter by
`zero3.gathered` (and once more in a backward that reads it), never per chunk of rows. An option the drop-in
cannot reproduce raises a ValueError naming it when the trainer is built (`check_supported`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import NamedTuple

import torch
from torch import Tensor, nn

try:
    import trl
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import nanmax, nanmin
except ImportError as error:  # pragma: no cover - exercised only without TRL
    raise ImportError("grpo_kernels.integrations.trl needs TRL >= 1.16: pip install 'grpo-kernels[trl]'") from error

from grpo_kernels.api import fused_linear_grpo_loss, fused_linear_token_logprobs
from grpo_kernels.integrations import hf, trl_one_pass, trl_replay, zero3
from grpo_kernels.integrations.trl_distillation import DistillationTrainer
from grpo_kernels.integrations.trl_precision import GRPOConfig, head_operands, head_precision
from grpo_kernels.integrations.trl_sampler_sync import StepGaps, check_trl_sampler_sync
from grpo_kernels.losses.loss import GRPOLossOutput
from grpo_kernels.option_checks import check_option
from grpo_kernels.options import CLIP_LOSS_TYPES, LossOptions
from grpo_kernels.rollout_correction import as_rollout_correction

__all__ = ["DistillationTrainer", "GRPOConfig", "GRPOTrainer", "check_supported", "head_precision", "patch"]

HEAD_KWARG = "grpo_kernels_head"  # the forward keyword that runs a fused head instead of the lm_head
ITEM_MEAN_TYPES = ("dapo", "cispo", "vespo")  # normalised by num_items_in_batch, which TRL rescales itself
# GRPOConfig fields TRL's loss reads from `args`, LossOptions fields of the same name and meaning
CONFIG_OPTIONS = ("sapo_temperature_pos", "sapo_temperature_neg", "use_bias_correction_kl")
CONFIG_OPTIONS += ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
REPLAY_METRICS = ("sampling/log_kept_mass", "sampling/outside_support")  # the loss's, when it replays a sampler
TYPE_METRICS = {  # TRL's loss-type-specific metrics (beside entropy and kl)
    **{loss_type: CLIP_METRICS for loss_type in CLIP_LOSS_TYPES},
    "cispo": ("cispo_clip_ratio",),
    "vespo": ("vespo/phi_seq_mean",),
}
# inputs (and `_get_per_token_logps_and_entropies` keywords) that only vision-language models carry
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes")
MULTIMODAL_KEYS += ("num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class LMHead(NamedTuple):
    """The output projection as the fused passes take it: logits = c·tanh(s·(hidden @ weight.T + bias)/c)."""

    weight: Tensor  # [V, H], gathered when the model holds it as a DTensor
    bias: Tensor | None  # [V]
    logit_scale: float  # s
    final_logit_softcapping: float | None  # c (None: no soft-capping)


class _FusedHead:
    """Overrides of trl.GRPOTrainer; mixed in before TRL's class (GRPOTrainer here, or by `patch`)."""

    def _compute_loss(self, model, inputs):
        """TRL's `_compute_loss` with the loss and its gradients from `fused_linear_grpo_loss`; the sampler-sync
        guard first (`trl_sampler_sync`)."""
        check_trl_sampler_sync(self, model, inputs)
        one_pass = trl_one_pass.applies(self, inputs)  # no old pass ran: π_old is this pass's (`trl_one_pass`)
        if one_pass and not trl_one_pass.fuses_correction(self, inputs):  # TRL's algebra on the fused log-probs
            self._gk_correct = dict(inputs)  # the pass sets its importance_sampling_ratio (`trl_one_pass.correct`)
            try:
                return super()._compute_loss(model, self._gk_correct)
            finally:
                self._gk_correct = None
        if self.top_entropy_quantile < 1.0:  # TRL's algebra on the fused log-probs: a quantile over all processes
            return super()._compute_loss(model, inputs)
        _check_text_only(inputs)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        num_completion = completion_ids.shape[1]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # [B, T]
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        bonus = self._applied_entropy_coef() if self._entropy_bonus_enabled else 0.0
        options = _loss_options(self, inputs, mode, bonus)
        tensors = trl_one_pass.loss_tensors(self, inputs) if one_pass else _loss_tensors(self, inputs)
        rule = trl_replay.sampling_rule(self.args)

        def head(last_hidden: Tensor, lm: LMHead, aux_loss: Tensor | None):
            hidden = last_hidden[:, -num_completion - 1 : -1]  # [B, T, H]: position p predicts token p + 1
            transform = dict(logit_scale=lm.logit_scale, final_logit_softcapping=lm.final_logit_softcapping)
            with head_operands(self, hidden, lm.weight, lm.bias) as (hidden, weight, bias, precision):
                out = fused_linear_grpo_loss(
                    hidden,
                    weight,
                    completion_ids,
                    mask=mask,
                    memory=trl_replay.memory_mode(rule, weight, mask),  # one route on every rank
                    bias=bias,
                    with_entropy=True,
                    head_precision=precision,
                    return_logprobs=one_pass,
                    options=dataclasses.replace(options, **transform),
                    **tensors,
                )
            return out, aux_loss

        with self.accelerator.autocast():
            out, aux_loss = model(**_model_inputs(inputs), **self._aux_kwargs(), **{HEAD_KWARG: head})
        if one_pass:  # the guard and the `sampling/*` metrics from the pass's log-probs, before the backward
            out, logprobs = out
            trl_one_pass.report(self, inputs, logprobs["logp"])
        # dapo/cispo/vespo carry the accumulation in num_items_in_batch; the others are divided here, as in TRL
        loss = out.loss if self.loss_type in ITEM_MEAN_TYPES else out.loss / accumulation
        if self._entropy_bonus_enabled:
            self._entropy_bonus_bookkeeping(out, options, mask, mode)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        # one pass: the replay metrics stay unlogged, as on the route through TRL's algebra beside it
        metrics = {name: x for name, x in out.metrics.items() if not (one_pass and name in REPLAY_METRICS)}
        self._log_loss_metrics(metrics, mask, inputs["advantages"], mode)
        return loss

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's log-prob pass (old, reference, and the policy under `top_entropy_quantile < 1`) through
        `fused_linear_token_logprobs`: (logp [B, T], entropy [B, T] | None, aux loss | None), 0 at padding."""
        _check_text_only(multimodal)
        skipped = trl_one_pass.stand_in(self, input_ids, logits_to_keep)  # the old pass, where it is not needed
        if skipped is not None:
            return skipped
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies, aux_losses = [], [], []
        rule = trl_replay.pass_rule(self, model)  # the sampler's truncation (the reference model: none by default)
        for start in range(0, input_ids.shape[0], batch_size):
            ids, attention = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]

            def head(last_hidden: Tensor, lm: LMHead, aux_loss: Tensor | None, ids=ids, attention=attention):
                hidden = last_hidden[:, -logits_to_keep - 1 : -1]  # [b, T, H]
                with head_operands(self, hidden, lm.weight, lm.bias) as (hidden, weight, bias, precision):
                    result = fused_linear_token_logprobs(
                        hidden,
                        weight,
                        ids[:, -logits_to_keep:],
                        memory=trl_replay.memory_mode(rule, weight, attention[:, -logits_to_keep:]),
                        bias=bias,
                        head_precision=precision,
                        temperature=self.temperature,
                        with_entropy=compute_entropy,
                        mask=attention[:, -logits_to_keep:].bool(),
                        logit_scale=lm.logit_scale,
                        final_logit_softcapping=lm.final_logit_softcapping,
                        **rule,
                    )
                return result, aux_loss

            aux = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                result, aux_loss = model(input_ids=ids, attention_mask=attention, **aux, **{HEAD_KWARG: head})
            logp, entropy = result if compute_entropy else (result, None)
            logps.append(logp)
            entropies.append(entropy)
            aux_losses.append(aux_loss)
        logp = torch.cat(logps)  # [B, T]
        correcting, self._gk_correct = getattr(self, "_gk_correct", None), None
        if correcting is not None:  # the loss pass of a micro-batch whose old pass was skipped: π_old is its own
            trl_one_pass.correct(self, correcting, logp.detach())
        return (
            logp,
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    def _generate_and_score_completions(self, inputs):
        """TRL's generation, without its old-log-prob pass where only the vLLM correction needs it and π_old is π_θ at
        the update (`trl_one_pass`)."""
        if not trl_one_pass.fuses_old_pass(self):
            return super()._generate_and_score_completions(inputs)
        with trl_one_pass.old_pass_skipped(self):
            output = super()._generate_and_score_completions(inputs)
        return trl_one_pass.without_stand_in(self, output)

    def _aux_kwargs(self) -> dict[str, bool]:
        return {"output_router_logits": True} if self.aux_loss_enabled else {}

    def _applied_entropy_coef(self) -> float:
        """The entropy bonus of this optimizer step (TRL's rule: the adaptive bonus acts only while the entropy
        measured at the last step is at or below `entropy_target`)."""
        if self.use_adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
            return 0.0
        return self.entropy_coef

    def _entropy_bonus_bookkeeping(self, out: GRPOLossOutput, options: LossOptions, mask: Tensor, mode: str) -> None:
        """TRL's `policy_loss` metric and adaptive entropy controller, from the loss's entropy (a mean over `mask`:
        without an entropy quantile the bonus acts on every kept token). The controller's state stays TRL's
        attributes, so TRL saves and restores it with the checkpoint."""
        entropy = out.metrics["entropy"]
        policy_loss = (out.loss + options.entropy_coef * entropy).detach()  # the loss before the bonus
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            tokens = mask.sum().to(entropy.dtype)
            stats = torch.stack([entropy * tokens, tokens])  # [2]: entropy sum, token count of this micro-batch
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:  # an optimizer step: update the coefficient from the whole window
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _log_loss_metrics(self, metrics: dict[str, Tensor], mask: Tensor, advantages: Tensor, mode: str) -> None:
        """TRL's loss metrics from the loss's local ones: each a mean over this process's tokens (or sequences, for
        per-sequence quantities), summed with its count over processes; the per-sequence clip extremes as the min /
        max over processes (logged when the loss reports them)."""
        names = ["entropy", *(["kl"] if self.beta != 0.0 else []), *TYPE_METRICS.get(self.loss_type, ())]
        names += [name for name in REPLAY_METRICS if name in metrics]
        names += [name for name in metrics if name.startswith("rollout_corr/")]  # the correction's (token-weighted)
        sequence_ratio = self.importance_sampling_level == "sequence" and advantages.dim() == 1  # one per sequence
        per_sequence = [
            n for n in names if n == "vespo/phi_seq_mean" or (sequence_ratio and n not in ("entropy", "kl"))
        ]
        tokens = mask.sum().to(torch.float32)
        sequences = torch.tensor(float(mask.shape[0]), device=mask.device)
        counts = torch.stack([sequences if name in per_sequence else tokens for name in names])  # [M]
        sums = torch.stack([metrics[name].float() for name in names]) * counts  # [M]
        totals = self.accelerator.reduce(torch.stack([sums, counts]), reduction="sum")  # [2, M]
        for name, value in zip(names, (totals[0] / totals[1].clamp(min=1.0)).tolist(), strict=True):
            self._metrics[mode][name].append(value)
        for name, extreme in (("clip_ratio/low_min", nanmin), ("clip_ratio/high_max", nanmax)):
            if self.loss_type in CLIP_LOSS_TYPES and name in metrics:
                local = metrics[name].float().reshape(1)  # [1]
                self._metrics[mode][name].append(extreme(self.accelerator.gather(local)).item())


class GRPOTrainer(_FusedHead, trl.GRPOTrainer):
    """`trl.GRPOTrainer` whose loss and log-prob passes run through grpo-kernels' fused lm_head (module docstring).

    Same constructor, same `GRPOConfig`; raises ValueError at construction for an option it cannot honour.
    """

    @functools.wraps(trl.GRPOTrainer.__init__)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _install(self)


def patch(trainer: trl.GRPOTrainer) -> trl.GRPOTrainer:
    """Switch an already built `trl.GRPOTrainer` (or a subclass keeping TRL's loss) to the fused passes, in place;
    returns it. Raises for a subclass that overrides the methods replaced here, and for unsupported options."""
    if not isinstance(trainer, trl.GRPOTrainer):
        raise TypeError(f"trainer must be a trl.GRPOTrainer, got {type(trainer).__name__}")
    if isinstance(trainer, _FusedHead):
        return trainer
    cls = type(trainer)
    for name in ("_compute_loss", "_get_per_token_logps_and_entropies"):
        if getattr(cls, name) is not getattr(trl.GRPOTrainer, name):
            raise ValueError(
                f"{cls.__name__} overrides {name}, which patch() would replace: "
                "apply its changes on grpo_kernels.integrations.trl.GRPOTrainer instead"
            )
    _install(trainer)  # checks first: an unsupported trainer is left as it was
    trainer.__class__ = GRPOTrainer if cls is trl.GRPOTrainer else type(cls.__name__, (_FusedHead, cls), {})
    return trainer


def check_supported(trainer: trl.GRPOTrainer) -> None:
    """Raise ValueError naming the first GRPOConfig option (or model) the fused passes cannot reproduce."""
    args, model = trainer.args, _unwrapped(trainer, trainer.model)
    if getattr(trainer, "_is_vlm", False) or hasattr(model.config, "vision_config"):
        raise ValueError(
            "vision inputs are not supported by grpo_kernels.integrations.trl: the fused lm_head runs the text "
            f"backbone only ({type(model).__name__}); use trl.GRPOTrainer for vision-language models"
        )
    if getattr(model, "active_peft_config", None) is not None and model.active_peft_config.is_prompt_learning:
        raise ValueError("PEFT prompt learning (virtual tokens) is not supported by grpo_kernels.integrations.trl")
    head_precision(args)
    trl_replay.check_sampler(args)  # top_k, top_p, min_p with the loss's messages, now rather than at the first loss
    check_option("temperature", args.temperature)
    correction, needed_loss = as_rollout_correction(getattr(args, "rollout_correction", None))
    if correction is not None and (needed_loss is not None or args.top_entropy_quantile < 1.0):
        raise ValueError(
            "rollout_correction: verl's REINFORCE presets (loss_type 'gpg') and top_entropy_quantile < 1 (TRL's own "
            "loss algebra) are not supported by grpo_kernels.integrations.trl"
        )
    if args.loss_type == "vespo" and args.importance_sampling_level == "sequence":
        if args.beta != 0.0 and args.use_bias_correction_kl:
            raise ValueError(
                "loss_type='vespo' with importance_sampling_level='sequence', beta != 0 and use_bias_correction_kl "
                "is not supported: VESPO's loss takes token-level ratios; set importance_sampling_level='token'"
            )
    for target in (model, trainer.ref_model):
        if target is not None:
            hf.lm_head(_hf_model(trainer, target))  # an lm_head that is not an nn.Linear raises here


def _loss_options(trainer: trl.GRPOTrainer, inputs: dict, mode: str, entropy_coef: float = 0.0) -> LossOptions:
    """The `LossOptions` of TRL's loss for this micro-batch: GRPOConfig's loss options, `num_items_in_batch`
    rescaled as TRL rescales it (to one accumulation window of one process), and the entropy bonus `entropy_coef`
    scaled for accumulation where TRL's loss type is not."""
    args = trainer.args
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    num_items = None
    if trainer.loss_type in ITEM_MEAN_TYPES:
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":  # TRL's items span the generation batch: steps_per_generation micro-batches
            num_items = num_items * accumulation / args.steps_per_generation
        entropy_coef = entropy_coef / accumulation  # the policy loss is not divided by accumulation below
    level = trainer.importance_sampling_level
    if trainer.loss_type == "vespo":  # its loss never uses the ratio at `level` (check_supported covers the KL)
        level = "token"
    return LossOptions(
        loss_type=trainer.loss_type,
        epsilon=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta if trainer.loss_type in CLIP_LOSS_TYPES else None,
        beta=trainer.beta,
        temperature=trainer.temperature,
        importance_sampling_level=level,
        max_completion_length=trainer.max_completion_length if trainer.loss_type == "dr_grpo" else None,
        num_items_in_batch=num_items,
        top_entropy_quantile=trainer.top_entropy_quantile,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        entropy_coef=entropy_coef,
        rollout_correction=getattr(args, "rollout_correction", None),
        **trl_replay.sampling_rule(args),
        **{name: getattr(args, name) for name in CONFIG_OPTIONS},
    )


def _loss_tensors(trainer: trl.GRPOTrainer, inputs: dict) -> dict[str, Tensor | None]:
    """The tensor arguments of `fused_linear_grpo_loss` from TRL's inputs (`_prepare_inputs`' keys)."""
    correction, _ = as_rollout_correction(getattr(trainer.args, "rollout_correction", None))
    if correction is not None:  # it forms the IS weight from the sampler's log-probs; bypass: they are π_old
        return {
            "advantages": inputs["advantages"],
            "old_logp": None if correction.bypass_mode else inputs.get("old_per_token_logps"),
            "ref_logp": inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
            "sampling_logp": inputs.get("sampling_per_token_logps"),
        }
    is_ratio = None
    if trainer.loss_type == "vespo":  # VESPO folds any rollout IS ratio into its sequence weight
        is_ratio = inputs.get("importance_sampling_ratio")
    elif trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        is_ratio = inputs["importance_sampling_ratio"]
    if is_ratio is not None and is_ratio.dim() == 2 and is_ratio.shape[1] == 1:
        is_ratio = is_ratio[:, 0]  # [B]: TRL's sequence-level IS modes give [B, 1]
    sampling = inputs.get("sampling_per_token_logps") if trainer.off_policy_mask_threshold is not None else None
    return {
        "advantages": inputs["advantages"],
        "old_logp": inputs.get("old_per_token_logps"),
        "ref_logp": inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        "is_ratio": is_ratio,
        "sampling_logp": sampling,
    }


def _model_inputs(inputs: dict) -> dict[str, Tensor]:
    """input_ids and attention_mask [B, P + T] of prompt ‖ completion, as TRL builds them."""
    return {
        "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
    }


def _check_text_only(fields: dict) -> None:
    present = sorted(key for key in MULTIMODAL_KEYS if fields.get(key) is not None)
    if present:
        raise ValueError(f"vision inputs ({', '.join(present)}) are not supported by grpo_kernels.integrations.trl")


def _install(trainer: trl.GRPOTrainer) -> None:
    """Check the options, then give the policy and the reference model the fused-head forward."""
    check_supported(trainer)
    trainer.add_callback(StepGaps())  # the guard's trend rule, kept in checkpoints
    for target in (trainer.model, trainer.ref_model):
        if target is not None:
            _install_forward(_hf_model(trainer, target))


def _unwrapped(trainer: trl.GRPOTrainer, model: nn.Module) -> nn.Module:
    return trainer.accelerator.unwrap_model(model)


def _hf_model(trainer: trl.GRPOTrainer, model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside accelerate's and PEFT's wrappers (LoRA layers stay inside it)."""
    model = _unwrapped(trainer, model)
    return model.get_base_model() if is_peft_model(model) else model


def _install_forward(model: nn.Module) -> None:
    """`model(..., grpo_kernels_head=head)` runs the backbone and returns `head(last_hidden_state, lm_head,
    aux_loss)`; without the keyword the forward is the one it had (TRL's fused-head forward, generation)."""
    if getattr(model.forward, "_grpo_kernels_head", False):
        return
    previous = model.forward

    @functools.wraps(type(model).forward)  # keeps the signature: `generate` checks its keywords against it
    def forward(self, *args, **kwargs):
        head = kwargs.pop(HEAD_KWARG, None)
        if head is None:
            return previous(*args, **kwargs)
        for name in ("labels", "shift_labels", "num_items_in_batch"):  # PEFT passes labels=None through
            kwargs.pop(name, None)
        kwargs["use_cache"] = False
        outputs = self.base_model(*args, **kwargs)  # looked up per call: FSDP and PEFT replace modules
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _router_aux_loss(self, outputs.router_logits, kwargs.get("attention_mask"))
        lm = _lm_head(self)
        with zero3.gathered(lm.weight, lm.bias):  # ZeRO-3: whole for this pass (and once in its backward)
            return head(outputs.last_hidden_state, lm, aux_loss)

    forward._grpo_kernels_head = True
    model.forward = types.MethodType(forward, model)


def _lm_head(model: nn.Module) -> LMHead:
    """The output projection, gathered whole when FSDP2 holds it as a DTensor (as TRL's fused head does)."""
    weight, bias = hf.lm_head(model)
    if _is_dtensor(weight):
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    return LMHead(weight, bias, *hf.logit_transform(model))


def _is_dtensor(x: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _router_aux_loss(model: nn.Module, router_logits, attention_mask: Tensor | None) -> Tensor:
    """The MoE load-balancing loss the model's own forward adds (transformers' Mixtral formula, which every MoE
    family reuses), from the backbone's router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return load_balancing_loss_func(router_logits, experts, config.num_experts_per_tok, attention_mask)

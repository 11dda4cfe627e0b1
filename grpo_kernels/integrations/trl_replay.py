"""The TRL drop-in's sampling replay: the truncation rule TRL's sampler ran (GRPOConfig's `top_k`, `top_p`, `min_p`,
overridden by `generation_kwargs` as TRL passes them to vLLM and to `generate`), applied to the policy's old and
current log-probs, so that vLLM's importance-sampling correction compares log-probs over the same tokens
(vLLM's `processed_logprobs` are renormalised over the tokens its sampler kept). The reference model's log-probs stay
full-vocabulary unless `GRPOConfig.replay_reference` is set (docs/sampling_replay.md)."""

from __future__ import annotations

import trl
from accelerate.utils import is_peft_model
from torch import Tensor, nn

from grpo_kernels.integrations.route import agreed_memory
from grpo_kernels.option_checks import check_option

RULE_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # the project's off values of the three options
# generate()'s other truncations, with their off values: the replay follows top-k, top-p and min-p only
UNREPLAYED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def sampling_rule(args: trl.GRPOConfig) -> dict[str, int | float]:
    """{"top_k", "top_p", "min_p"} as TRL's sampler runs them, in the project's off values (top_k 0, top_p 1.0,
    min_p 0.0; vLLM's top_k -1 and TRL's min_p None are off too). An invalid value is the TypeError or ValueError
    `option_checks` gives for it everywhere."""
    given = args.generation_kwargs or {}  # TRL parses a JSON string into a dict
    top_k = given.get("top_k", args.top_k)
    top_p = given.get("top_p", args.top_p)
    min_p = given.get("min_p", args.min_p)
    if top_k is None or top_k == -1:
        top_k = 0
    if min_p is None:
        min_p = 0.0
    for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        check_option(name, value)  # the message the loss functions and LossOptions give for this value
    return {"top_k": top_k, "top_p": float(top_p), "min_p": float(min_p)}


def check_sampler(args: trl.GRPOConfig) -> None:
    """Raise ValueError for a sampler whose kept set the replay cannot reproduce: transformers' `generate` applies
    min-p after top-p (vLLM, whose order the replay follows, before it), and its typical-p, epsilon and eta
    truncations have no replay."""
    rule = sampling_rule(args)
    if args.use_vllm:
        return
    given = args.generation_kwargs or {}
    for name, off in UNREPLAYED.items():
        if given.get(name, off) not in (None, off):
            raise ValueError(
                f"generation_kwargs[{name!r}]={given[name]!r} truncates sampling in a way the drop-in does not replay "
                "(it replays top_k, top_p and min_p): remove it, or use trl.GRPOTrainer"
            )
    if rule["min_p"] > 0.0 and rule["top_p"] < 1.0:
        raise ValueError(
            f"min_p={rule['min_p']} with top_p={rule['top_p']} under transformers' generate (use_vllm=False): it "
            "applies min-p after top-p, vLLM (whose order the replay follows) before it, so the kept sets differ; "
            "use vLLM, or one of the two"
        )


def pass_rule(trainer: trl.GRPOTrainer, model: nn.Module) -> dict[str, int | float]:
    """The rule one log-prob pass replays: the sampler's for the policy, none for the reference model (unless
    `GRPOConfig.replay_reference`)."""
    if is_reference_pass(trainer, model) and not getattr(trainer.args, "replay_reference", False):
        return dict(RULE_OFF)
    return sampling_rule(trainer.args)


def memory_mode(rule: dict[str, int | float], weight: Tensor, mask: Tensor) -> str:
    """The fused head's memory mode: "fast" for a pass that replays a sampler (the lean route cannot: its tiles never
    hold a row's logits whole; every rank replays the same rule, so they agree), else `agreed_memory`'s choice."""
    return "fast" if rule != RULE_OFF else agreed_memory(weight, mask)


def is_reference_pass(trainer: trl.GRPOTrainer, model: nn.Module) -> bool:
    """Whether TRL calls its log-prob pass for the reference model: the separate reference model, or (PEFT) the
    policy with its adapters disabled or the adapter named "ref" active, as TRL's `use_adapter` sets them."""
    if trainer.ref_model is not None and model is trainer.ref_model:
        return True
    unwrapped = trainer.accelerator.unwrap_model(model)
    if not is_peft_model(unwrapped):
        return False
    return unwrapped.active_adapter == "ref" or unwrapped.get_model_status().enabled is False

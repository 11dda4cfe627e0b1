"""The policy's dropout: which rates are on, turning them off (TRL's `disable_dropout`), and how the sampler-sync
guard names them. Dropout draws a different network at each pass, so a pass in train mode does not give the log-probs
the sampler had: the trainer runs generation and its scoring passes in eval mode, and the update pass gives π_old
only without dropout (`old_logprobs.py`)."""

from __future__ import annotations

from torch import nn


def active_dropout(model: nn.Module) -> dict[str, str]:
    """`model`'s dropouts with a non-zero rate, by module name: `nn.Dropout` modules ("nn.Dropout(p=0.1)") and the
    attention probabilities' dropout that Hugging Face's attention modules keep as a float ("attention_dropout=0.1")."""
    active = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            active[name] = f"nn.Dropout(p={module.p:g})"
        elif isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            active[name] = f"attention_dropout={module.attention_dropout:g}"
    return active


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of `model` set to 0 (TRL's `disable_dropout`), the attention modules' float rates included,
    which TRL's `disable_dropout_in_model` (nn.Dropout only) leaves on."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def dropout_settings(model: nn.Module) -> tuple[str, ...]:
    """The model's dropout above 0 as the guard names it: its config's `*dropout*` / `*pdrop*` fields as
    `name=value`, else the active rates; none where every rate is 0 (`disable_dropout`), whatever the config says."""
    if not active_dropout(model):
        return ()
    config = getattr(model, "config", None)
    named = [
        f"{name}={value:g}"
        for name, value in sorted(vars(config).items() if config is not None else ())
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float | int) and not isinstance(value, bool)
        if value > 0
    ]
    return tuple(named) or tuple(sorted(set(active_dropout(model).values())))

"""Which attention kernel a Hugging Face model runs, and whether it can run packed (padding-free) sequences.

Packed sequences share one row; `position_ids` restarting at 0 mark where each begins, and the packed forward
passes their `cu_seqlens` too (`varlen_kwargs`). The implementations:
- `flash_attention_2`: transformers runs flash-attn's varlen kernels on the `cu_seqlens` (CUDA);
- `sdpa`: `_varlen_sdpa`, registered with transformers under `VARLEN_SDPA`, runs torch's SDPA kernel once per
  sequence, causal, so no token attends across a boundary or to padding; a call without `cu_seqlens`
  (generation, padded passes) or from a sliding-window layer is transformers' own sdpa with its mask;
- `eager`: transformers' block-diagonal causal mask built from the positions (tests; its cost is that of one
  sequence of all the tokens).
A model whose code ignores the positions (custom or recurrent layers) would attend across sequences:
`packing_support` runs it on two short sequences packed and apart, and names what differs.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
from torch import nn

ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "sdpa", "eager")
VARLEN_SDPA = "grpo_kernels_varlen_sdpa"  # the name `sdpa` is registered under with transformers


def flash_attn_available() -> bool:
    """Whether the `flash-attn` package is importable (it builds for CUDA only)."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(requested: str, device: torch.device | str) -> str:
    """The attention implementation `requested` names: `auto` is flash_attention_2 when flash-attn is importable and
    the device is CUDA, else sdpa. flash_attention_2 without flash-attn, or off CUDA, is a ValueError naming the fix."""
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}, got {requested!r}")
    cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "flash_attention_2" if cuda and flash_attn_available() else "sdpa"
    if requested == "flash_attention_2" and not flash_attn_available():
        raise ValueError(
            "attn_implementation 'flash_attention_2' needs the flash-attn package, which is not installed: "
            "pip install 'grpo-kernels[flash-attn]' --no-build-isolation (CUDA), or use sdpa"
        )
    if requested == "flash_attention_2" and not cuda:
        raise ValueError(f"attn_implementation 'flash_attention_2' runs on CUDA only, the model is on {device}")
    return requested


def set_attn_implementation(model: nn.Module, requested: str) -> str:
    """Switch `model` (and its sub-configs) to the resolved implementation; returns its name. Under `auto`, a model
    without flash-attn support takes sdpa, and one without sdpa support keeps the implementation it has."""
    device = next(model.parameters()).device
    name = resolve_attn_implementation(requested, device)
    if requested == "auto" and name == "flash_attention_2" and not getattr(model, "_supports_flash_attn", True):
        name = "sdpa"
    if requested == "auto" and name == "sdpa" and not getattr(model, "_supports_sdpa", True):
        return model.config._attn_implementation
    if name == "sdpa":
        _register_varlen_sdpa()
    internal = VARLEN_SDPA if name == "sdpa" else name
    if getattr(model.config, "_attn_implementation", None) != internal:
        model.set_attn_implementation(internal)
    return name


def packing_support(model: nn.Module) -> str | None:
    """None when `model` runs packed sequences as it runs them apart, else why not (one short phrase).

    Checks that its decoder takes `position_ids`, then runs two short sequences packed in one row and each alone
    (no gradients, eval mode) and compares the second one's hidden states: attention across the boundary, or any
    state carried over it, changes them by far more than float error."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or "position_ids" not in inspect.signature(decoder.forward).parameters:
        return f"{type(model).__name__}'s decoder takes no position_ids"
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    first = torch.arange(1, 6, device=device) % vocab  # [5]
    second = torch.arange(7, 10, device=device) % vocab  # [3]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            apart = decoder(input_ids=second[None], use_cache=False).last_hidden_state[0]  # [3, H]
            position_ids = torch.cat([torch.arange(5, device=device), torch.arange(3, device=device)])[None]
            kwargs = varlen_kwargs(model, torch.tensor([0, 5, 8], device=device, dtype=torch.int32), 5)
            packed = decoder(
                input_ids=torch.cat([first, second])[None], position_ids=position_ids, use_cache=False, **kwargs
            ).last_hidden_state[0, 5:]  # [3, H]
    except (TypeError, ValueError, RuntimeError) as error:
        return f"its packed forward fails ({type(error).__name__}: {' '.join(str(error).split())[:200]})"
    finally:
        model.train(training)
    scale = apart.float().abs().max().clamp(min=1e-6)
    difference = float((packed.float() - apart.float()).abs().max() / scale)
    tolerance = 1e-4 if apart.dtype == torch.float32 else 3e-2
    if not difference <= tolerance:
        return f"a packed sequence sees its neighbour (relative difference {difference:.2g} > {tolerance:g})"
    return None


def varlen_kwargs(model: nn.Module, cu_seqlens: torch.Tensor, max_length: int) -> dict:
    """flash-attn's varlen arguments for a packed forward under flash_attention_2 (transformers would otherwise
    derive them from `position_ids` in every layer); nothing for the mask-based implementations."""
    implementation = str(getattr(model.config, "_attn_implementation", ""))
    if "flash" not in implementation and implementation != VARLEN_SDPA:
        return {}
    return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_length, max_length_k=max_length)


def _register_varlen_sdpa() -> None:
    """Register `_varlen_sdpa` (and sdpa's mask) with transformers under `VARLEN_SDPA`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, _varlen_sdpa)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)


def _varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: query [1, heads, N, d], key / value [1, kv_heads, N, d] of packed
    sequences (`cu_seq_lens_q`) -> [1, N, heads, d], torch's SDPA per sequence, causal."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or kwargs.get("sliding_window") is not None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [1, heads, N, d]
    bounds = bounds.tolist()
    out = torch.cat(
        [
            nn.functional.scaled_dot_product_attention(
                query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, scale=scaling, is_causal=True
            )
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            if b > a
        ],
        dim=2,
    )  # [1, heads, N, d]
    return out.transpose(1, 2).contiguous(), None

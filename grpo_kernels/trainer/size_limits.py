"""Absurd sizes are refused before anything is allocated: a ValueError naming the options and the memory they
would need, against the machine's physical memory, instead of an allocator's traceback minutes later.

The estimates are lower bounds (what a run cannot do without), so a refused run could never have started:
- the tiny demo model: 16 bytes a parameter (float32 weights, gradients and AdamW's two moments), with 12·H² a
  layer (attention 4·H², SwiGLU MLP 3·H·4H) and the tied embedding V·H;
- the rollout batch: `prompts_per_step · num_generations` sequences of `max_completion_length` tokens, each with
  at least its float32 hidden state and the last position's logits over the vocabulary while sampling.
"""

from __future__ import annotations

import os

BYTES_PER_PARAMETER = 16  # float32 weights + gradients + AdamW's exp_avg and exp_avg_sq
DEMO_VOCABULARY = 64  # an upper bound of the demo tokenizers' vocabularies (characters and special tokens)


def physical_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_sizes(config, memory: int | None = None) -> None:
    """A ValueError naming the options whose sizes alone need more than `memory` bytes (default: the machine's)."""
    memory = physical_memory() if memory is None else memory
    needs = []
    if config.model == "tiny":
        H = config.hidden_size
        parameters = config.num_layers * 12 * H * H + DEMO_VOCABULARY * H
        needs.append((parameters * BYTES_PER_PARAMETER, "--hidden-size, --num-layers", "the tiny model's training"))
    sequences = config.prompts_per_step * config.num_generations
    per_sequence = (config.max_completion_length or 1) * 4 * (config.hidden_size if config.model == "tiny" else 1)
    needs.append((sequences * per_sequence, "--prompts-per-step, --num-generations", "one rollout batch"))
    for need, flags, what in needs:
        if need > memory:
            raise ValueError(
                f"{flags}: {what} needs at least {_gib(need)} of memory, more than this machine's {_gib(memory)} "
                f"(hidden_size {config.hidden_size}, num_layers {config.num_layers}, prompts_per_step "
                f"{config.prompts_per_step}, num_generations {config.num_generations}); choose smaller sizes"
            )


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"

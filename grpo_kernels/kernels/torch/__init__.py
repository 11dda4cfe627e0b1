"""The torch backend: the vocabulary pass in PyTorch ops (`token_logprobs.py`, the readable reference of the
others), its closed-form loss epilogue (`grpo_loss.py`) and the lean fused lm_head's tiles (`lean.py`), and its
record."""

from __future__ import annotations

import torch

from grpo_kernels.kernels.protocol import EPILOGUE_KL, HALF_AND_SINGLE, Capabilities

RECORD = Capabilities(
    name="torch",
    module="grpo_kernels.kernels.torch.token_logprobs",
    dtypes=(*HALF_AND_SINGLE, torch.float64),
    stats=True,
    epilogue_module="grpo_kernels.kernels.torch.grpo_loss",
    epilogue_kl=EPILOGUE_KL,
    epilogue_needs_grad=True,  # ops, not kernels: dL/dlogp saves the algebra's autograd graph, nothing more
    tile_module="grpo_kernels.kernels.torch.lean",
)

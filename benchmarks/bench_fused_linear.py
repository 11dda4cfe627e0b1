"""fused_linear_grpo_loss: hidden [N, H] and an lm_head [V, H] in, forward and forward + backward, against the eager
loss on materialised logits, torch.compile of it, and Liger's chunked LigerFusedLinearGRPOLoss. Floor: the lm_head
GEMMs (1 forward, 3 with the backward), timed in the same run."""

import pytest

from benchmarks.cases import MODES, providers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", providers("fused_linear"))
def bench_fused_linear(measure, provider, shape, mode):
    measure("fused_linear", provider, shape, mode)

"""grpo_loss on materialised logits [N, V] (the lm_head GEMM is outside the timed call), forward and
forward + backward. Floor: the bytes it must move (logits read twice, gradient written once), timed as a copy."""

import pytest

from benchmarks.cases import MODES, providers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", providers("grpo_loss"))
def bench_grpo_loss(measure, provider, shape, mode):
    measure("grpo_loss", provider, shape, mode)

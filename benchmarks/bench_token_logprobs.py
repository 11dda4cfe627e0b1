"""fused_linear_token_logprobs (the old- and reference-policy pass): forward, and forward + backward, against
log_softmax(hidden @ W.T).gather. Floor: the lm_head GEMMs."""

import pytest

from benchmarks.cases import MODES, providers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", providers("token_logprobs"))
def bench_token_logprobs(measure, provider, shape, mode):
    measure("token_logprobs", provider, shape, mode)

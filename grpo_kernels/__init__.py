"""grpo-kernels: fused vocabulary-pass kernels and the GRPO loss family, with TRL's argument names."""

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.api import fused_linear_grpo_loss, fused_linear_token_logprobs, grpo_loss, token_logprobs
from grpo_kernels.distillation import DivergenceOutput, FusedLinearDivergence, fused_linear_divergence
from grpo_kernels.engine.replay import SamplingMask
from grpo_kernels.losses.loss import GRPOLossOutput
from grpo_kernels.losses.policy import POLICY_LOSSES
from grpo_kernels.modules import GRPOLoss
from grpo_kernels.options import LOSS_TYPES, LossOptions
from grpo_kernels.regularizers import REGULARIZERS
from grpo_kernels.rewards import REWARDS
from grpo_kernels.sampling import SAMPLERS

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGES",
    "DivergenceOutput",
    "FusedLinearDivergence",
    "GRPOLoss",
    "GRPOLossOutput",
    "LOSS_TYPES",
    "LossOptions",
    "POLICY_LOSSES",
    "REGULARIZERS",
    "REWARDS",
    "SAMPLERS",
    "SamplingMask",
    "__version__",
    "fused_linear_divergence",
    "fused_linear_grpo_loss",
    "fused_linear_token_logprobs",
    "grpo_loss",
    "token_logprobs",
]

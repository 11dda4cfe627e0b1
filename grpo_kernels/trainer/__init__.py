"""A lightweight GRPO trainer on the fused kernels: `train(TrainConfig(...))`, or `python -m grpo_kernels.train`."""

from grpo_kernels.trainer.config import TrainConfig, parse_args
from grpo_kernels.trainer.rollout import HFRollout, Rollout, RolloutBatch
from grpo_kernels.trainer.train import train

__all__ = ["HFRollout", "Rollout", "RolloutBatch", "TrainConfig", "parse_args", "train"]

"""Errors that point at the fix: a hidden / weight width mismatch names both shapes and the disagreeing dimension;
a misspelt loss option suggests the closest valid name."""

import pytest
import torch

import grpo_kernels as gk


def test_hidden_weight_mismatch_names_both_shapes_and_the_dimension():
    hidden, weight, targets = torch.randn(2, 3, 512), torch.randn(320, 256), torch.zeros(2, 3, dtype=torch.long)
    message = r"hidden \[2, 3, 512\] and weight \[320, 256\] disagree on H: hidden's last dimension is 512, weight's"
    with pytest.raises(ValueError, match=message):
        gk.fused_linear_token_logprobs(hidden, weight, targets)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] \(2-D\), got \[320\]"):
        gk.fused_linear_token_logprobs(hidden, torch.randn(320), targets)


def test_a_misspelt_option_suggests_the_closest_name():
    with pytest.raises(TypeError, match=r"\['epsilon_hgh'\] \('epsilon_hgh': did you mean 'epsilon_high'\?\)"):
        gk.LossOptions.from_kwargs(epsilon_hgh=0.28)
    with pytest.raises(TypeError, match=r"did you mean 'loss_type'\?"):
        gk.grpo_loss(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1), los_type="dapo")
    with pytest.raises(TypeError, match=r"unknown loss option\(s\) \['zzz'\]; valid options"):  # nothing close
        gk.LossOptions.from_kwargs(zzz=1)

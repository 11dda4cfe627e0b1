"""Loss options and the public functions' arguments at the boundary: every float option finite, every type checked
first and named, contradictions refused where the names given can be seen, a tensor normaliser <= 0 refused like
the Python value; a list cu_seqlens is converted."""

import math

import pytest
import torch

from grpo_kernels import GRPOLoss, LossOptions, fused_linear_grpo_loss, grpo_loss, presets, token_logprobs
from grpo_kernels.trainer import parse_args

B, T, V, H = 2, 3, 7, 4


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    return torch.randn(B, T, V), torch.randint(V, (B, T)), torch.randn(B)


@pytest.mark.parametrize(
    "name", ["entropy_coef", "vespo_k_pos", "loss_scale_factor", "temperature", "epsilon", "beta", "logit_scale"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_float_option_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name} must be (> 0 and )?finite"):
        LossOptions(**{name: value})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(temperature="1.0"), "temperature must be a float, got str '1.0'"),
        (dict(loss_type="dr_grpo", max_completion_length=512.0), "max_completion_length must be an int or None"),
        (dict(use_bias_correction_kl="yes"), "use_bias_correction_kl must be a bool"),
        (dict(epsilon=None), "epsilon must be a float"),
    ],
)
def test_a_loss_option_of_the_wrong_type_is_a_type_error_naming_it(options, message):
    with pytest.raises(TypeError, match=message):
        LossOptions(**options)


def test_epsilon_and_epsilon_low_both_given_and_different_are_refused(inputs, tmp_path):
    logits, targets, advantages = inputs
    for call in (
        lambda: grpo_loss(logits, targets, advantages, epsilon=0.2, epsilon_low=0.1),
        lambda: GRPOLoss(epsilon=0.2, epsilon_low=0.1),
        lambda: LossOptions.from_kwargs(epsilon=0.2, epsilon_low=0.1),
        lambda: parse_args(["--epsilon", "0.2", "--epsilon-low", "0.1"]),
    ):
        with pytest.raises(ValueError, match="epsilon_low is an alias of epsilon"):
            call()
    config = tmp_path / "c.yaml"
    config.write_text("loss: {epsilon: 0.2, epsilon_low: 0.1}\n", encoding="utf-8")
    with pytest.raises(ValueError, match="epsilon_low is an alias of epsilon"):
        parse_args(["--config", str(config)])
    assert LossOptions(epsilon_low=0.1).epsilon == 0.1 and LossOptions().epsilon == 0.2  # TRL's default kept
    assert parse_args(["--epsilon-low", "0.1"]).loss.epsilon == 0.1  # the flag replaces the preset's epsilon
    assert parse_args(["--preset", "dapo", "--epsilon-low", "0.1"]).loss.epsilon == 0.1


@pytest.mark.parametrize("items", [-3.0, 0.0])
def test_a_tensor_num_items_in_batch_at_or_below_zero_is_refused_like_the_number(inputs, items):
    logits, targets, advantages = inputs
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H)
    for value in (items, torch.tensor(items)):
        with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
            grpo_loss(logits, targets, advantages, num_items_in_batch=value)
        with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
            fused_linear_grpo_loss(hidden, weight, targets, advantages, num_items_in_batch=value)
    with pytest.raises(ValueError, match="num_sequences_in_batch must be > 0"):
        grpo_loss(logits, targets, advantages, num_sequences_in_batch=torch.tensor(items))
    grpo_loss(logits, targets, advantages, num_items_in_batch=torch.tensor(items), check_finite=False)  # unchecked


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, t, a: token_logprobs(x, t, temperature="1.0"), "temperature must be a float, got str"),
        (lambda x, t, a: token_logprobs(x, t, stats=None), "stats must be a sequence of names, got NoneType"),
        (lambda x, t, a: token_logprobs(x, t.float()), "targets must be int64 or int32 token ids"),
        (lambda x, t, a: grpo_loss(x, t, a, process_group=object()), "process_group must be a torch.distributed"),
        (lambda x, t, a: grpo_loss(x, t, a, sequence_group="world"), "sequence_group must be a torch.distributed"),
        (lambda x, t, a: grpo_loss(x, t, a, temperature="1.0"), "temperature must be a float, got str"),
        (lambda x, t, a: grpo_loss(x, t, a, check_finite="yes"), "check_finite must be a bool"),
        (lambda x, t, a: grpo_loss(x, t, a.tolist()), "advantages must be a torch.Tensor, got list"),
        (lambda x, t, a: grpo_loss(x, t, a, cu_seqlens="0,3,6"), "cu_seqlens must be an integer torch.Tensor"),
        (lambda x, t, a: GRPOLoss()(x, t.float(), a), "targets must be int64 or int32 token ids"),
        (lambda x, t, a: fused_linear_grpo_loss(x, torch.randn(V, V), t, a, vocab_start=2.5), "vocab_start must be"),
    ],
)
def test_a_wrong_argument_type_is_a_type_error_naming_it(inputs, call, message):
    with pytest.raises(TypeError, match=message):
        call(*inputs)


def test_a_list_cu_seqlens_is_converted(inputs):
    logits, targets, advantages = inputs
    packed = dict(logits=logits.reshape(B * T, V), targets=targets.reshape(B * T), advantages=advantages)
    want = grpo_loss(**packed, cu_seqlens=torch.tensor([0, T, 2 * T])).loss
    for cu_seqlens in ([0, T, 2 * T], (0, T, 2 * T)):
        assert torch.equal(grpo_loss(**packed, cu_seqlens=cu_seqlens).loss, want)


@pytest.mark.parametrize(
    ("section", "change", "message"),
    [
        ("loss", {"entropy_coef": math.nan}, "loss.entropy_coef must be finite"),
        ("training", {"learning_rate": math.inf}, "training.learning_rate must be finite"),
        ("rewards", [{"name": "math_answer", "weight": math.nan}], r"rewards\[0\].weight must be finite"),
        ("loss", {"temperature": "1.0"}, "loss.temperature must be a float"),
    ],
)
def test_a_presets_non_finite_or_mistyped_value_is_refused_when_loaded(section, change, message):
    data = presets.load("grpo").to_dict()
    data[section] = {**data[section], **change} if isinstance(change, dict) else change
    with pytest.raises((TypeError, ValueError), match=message):
        presets.from_dict(data)

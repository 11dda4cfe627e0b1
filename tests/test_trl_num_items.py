"""`num_items_in_batch` exactly as stock TRL 1.16's `_compute_loss`: TRL clamps its token count at 1, then rescales
it to one accumulation window of one process (÷ processes · accumulation ÷ steps_per_generation), which falls below
1 on small global batches; the drop-in divides by that value as it is. Every loss type, against stock TRL's own
code, with `steps_per_generation > gradient_accumulation_steps`, in one process (two processes: the case
`dapo_items_below_one` of tests/test_trl.py's data-parallel test)."""

import pytest
import torch

from grpo_kernels import grpo_loss

pytest.importorskip("trl")

from tests.test_trl import (  # noqa: E402, F401  (model_path and tokenizer: fixtures)
    LOSS_TYPES,
    assert_same,
    build,
    make_inputs,
    model_path,
    pair,
    tokenizer,
)

SMALL = dict(steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=2)


@pytest.mark.parametrize(
    ("loss_type", "items"), [*((loss_type, 1) for loss_type in LOSS_TYPES), ("dapo", 3), ("cispo", 3)]
)
def test_normalisers_below_one_match_trl(model_path, tokenizer, loss_type, items):  # noqa: F811
    """TRL's normaliser here is items · 2 / 4: 0.5 (and 1.5) for item-mean losses (dapo, cispo, vespo); the others
    ignore it. The drop-in used to clamp 0.5 up to 1 (half TRL's loss)."""
    stock, ours = pair(model_path, tokenizer, loss_type=loss_type, beta=0.04, **SMALL)
    inputs = make_inputs(stock, ref=True)
    inputs["num_items_in_batch"] = torch.tensor(items)
    loss, _ = assert_same(stock, ours, inputs, accumulation=2)
    assert loss != 0.0


def test_a_fractional_num_items_in_batch_divides_the_token_sum():
    """The functional API: `num_items_in_batch=0.5` is Z = 0.5 (twice the token sum), as documented."""
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 3, 11, generator=g), torch.randint(0, 11, (2, 3), generator=g)
    advantages = torch.randn(2, generator=g)
    old = torch.randn(2, 3, generator=g) * 0.1 - 2.4
    one = grpo_loss(logits, targets, advantages, old_logp=old, loss_type="dapo", num_items_in_batch=1.0).loss
    half = grpo_loss(logits, targets, advantages, old_logp=old, loss_type="dapo", num_items_in_batch=0.5).loss
    torch.testing.assert_close(half, 2 * one, rtol=1e-6, atol=0.0)

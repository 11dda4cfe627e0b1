"""The Triton vocabulary pass cut into V-blocks (split-V: partial statistics per (row, V-block), merged per row),
forced on small shapes by lowering `token_logprobs_triton.MIN_SPLIT_COLUMNS`, against the float64 oracle: every hard
case (V not a multiple of the tile, masked rows full of NaN, −inf logits, strided rows), soft-capping and the optional
statistics, the fused loss epilogue; and the tiling itself, split or not, on rows whose start is not 16-byte aligned
(sliced views with odd row strides), in place and not."""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels.triton import token_logprobs as token_logprobs_triton
from tests import test_grpo_loss, test_token_logprobs, test_token_stats
from tests.cases import CASE_IDS, CASES, make_inputs
from tests.conftest import DEVICE, DTYPES, assert_close
from tests.helpers import loss_inputs, oracle_logits, ours_and_oracle


@pytest.fixture
def split(monkeypatch):
    """Split every row of V >= 32 into V-blocks of (at least) 16 columns."""
    monkeypatch.setattr(token_logprobs_triton, "MIN_SPLIT_COLUMNS", 16)


def assert_split(logits: torch.Tensor) -> None:
    assert token_logprobs_triton.vocab_plan(logits)["splits"] > 1, "the launch did not split V"


def test_v_splits_threshold():
    """The documented threshold on an H100 (132 SMs): split below 1584 rows (2 waves of 6 programs per SM), into
    blocks of at least 16,384 columns."""
    v_splits = token_logprobs_triton.v_splits
    assert v_splits(64, 151_936, 132) == 9  # V // MIN_SPLIT_COLUMNS bounds it
    assert v_splits(600, 151_936, 132) == 3
    assert v_splits(1_000, 151_936, 132) == 2
    assert v_splits(1_583, 151_936, 132) == 2
    assert v_splits(1_584, 151_936, 132) == 1
    assert v_splits(16_384, 151_936, 132) == 1
    assert v_splits(8, 32_000, 132) == 1  # too narrow to cut
    assert v_splits(1, 10_000_000, 132) == token_logprobs_triton.MAX_V_SPLITS
    assert v_splits(0, 151_936, 132) == 1


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_forward_and_backward_match_oracle(split, dtype, case, launches):
    assert_split(make_inputs(case, dtype, DEVICE)["logits"])
    test_token_logprobs.test_matches_reference("triton", dtype, case, launches)


@pytest.mark.parametrize("transform", test_token_stats.TRANSFORMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_split_stats_match_formulas(split, dtype, case, transform, launches):
    test_token_stats.test_stats_match_formulas("triton", dtype, case, transform, launches)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_split_fused_loss_matches_oracle(split, dtype, case, launches):
    """A token-level loss formed in the split pass's epilogue (partial statistics merged, then the loss per token)."""
    inputs = loss_inputs(case, dtype, DEVICE, seed=11)
    assert_split(inputs["logits"])
    options = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    ours, oracle = ours_and_oracle(inputs, "triton", temperature=case.temperature, **options)
    test_grpo_loss.assert_matches(ours, oracle, dtype, expect_kl=True)
    assert launches == {"triton": 2, "fused_epilogue": 1}


def _sliced(V: int, dtype: torch.dtype, offset: int, pad: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """[B, T, V] logits viewed at column `offset` of rows `V + pad` wide (so most rows start off a 16-byte boundary),
    targets and mask; the rest of the buffer is NaN, which a pass that reads outside its rows would spread."""
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 4
    wide = torch.full((B, T, V + pad), float("nan"))
    wide[..., offset : offset + V] = torch.randn(B, T, V, generator=g) * 3
    wide[0, 1, offset : offset + V : 3] = float("-inf")
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 0], targets[1, 0] = 0, V - 1
    wide[0, 1, offset + targets[0, 1]] = 0.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2] = False
    wide[1, 2] = float("nan")
    logits = wide.to(dtype)[..., offset : offset + V]
    return logits.to(DEVICE), targets.to(DEVICE), mask.to(DEVICE)


UNALIGNED_SPLIT_COLUMNS = 8
# "split" only where it cuts: v_splits leaves a row narrower than 2 · MIN_SPLIT_COLUMNS whole, the "one" cell's pass
UNALIGNED_SPLITS = [
    (V, splits)
    for V in (1, 7, 45, 300)
    for splits in ("one", "split")
    if splits == "one" or V >= 2 * UNALIGNED_SPLIT_COLUMNS
]


@pytest.mark.parametrize("inplace", (True, False))
@pytest.mark.parametrize("layout", ((1, 3), (3, 5), (0, 1), (7, 9)), ids=lambda x: f"offset{x[0]}_pad{x[1]}")
@pytest.mark.parametrize("V,splits", UNALIGNED_SPLITS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_unaligned_rows(dtype, V, splits, layout, inplace, monkeypatch):
    """Head (before the first 16-byte boundary), whole aligned tiles and tail of every row, in each V-block; the
    backward's stores in place (the logits' alignment) and into a new contiguous buffer (another alignment)."""
    if splits == "split":
        monkeypatch.setattr(token_logprobs_triton, "MIN_SPLIT_COLUMNS", UNALIGNED_SPLIT_COLUMNS)
    logits, targets, mask = _sliced(V, dtype, *layout)
    if splits == "split":
        assert_split(logits)
    ref_logits = oracle_logits(logits)
    logits = logits.detach().requires_grad_()
    w = torch.randn(2, *mask.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logp, ent = gk.token_logprobs(logits, targets, with_entropy=True, mask=mask, inplace=inplace, backend="triton")
    ((logp * w[0]).sum() + (ent * w[1]).sum()).backward()
    m = mask.cpu().double()
    ref_logp, ref_ent = reference.token_logprobs(ref_logits, targets.cpu())
    ((ref_logp * m * w[0].cpu()).sum() + (ref_ent * m * w[1].cpu()).sum()).backward()
    assert_close(logp, ref_logp * m, dtype, "logp")
    assert_close(ent, ref_ent * m, dtype, "entropy")
    assert_close(logits.grad, ref_logits.grad, dtype, "grad logits")


def test_merge_of_a_row_whose_first_blocks_are_all_neg_inf(split):
    """V-blocks holding only −inf logits contribute nothing (no NaN from −inf − (−inf)) to the merged row."""
    logits = torch.randn(1, 2, 200, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits[0, 0, :150] = float("-inf")
    logits[0, 1, 1::2] = float("-inf")
    targets = torch.tensor([[170, 4]], device=DEVICE)
    mask = torch.ones(1, 2, dtype=torch.bool, device=DEVICE)
    assert_split(logits)
    logp, ent = gk.token_logprobs(logits, targets, with_entropy=True, mask=mask, backend="triton")
    ref_logp, ref_ent = reference.token_logprobs(oracle_logits(logits), targets.cpu())
    assert_close(logp, ref_logp, torch.float32, "logp")
    assert_close(ent, ref_ent, torch.float32, "entropy")

"""top-p's cut found by the binned scan (`kernels.replay.top_p_scan`) is the rule's, as the walk over the sorted
row (`_top_p_cut`) finds it, ties and values on a bin's edge included; the in-place masking keeps the support."""

import math

import pytest
import torch

from grpo_kernels.kernels.pass_options import Replay
from grpo_kernels.kernels.replay import RowReduce, Scratch, _top_p_cut, fill_below_, keep_ids_, thresholds, top_p_scan


def rows_of(kind: str, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(kind) * 7 + V)
    z = torch.randn(6, V, generator=g)
    if kind == "wide":
        z *= 8.0
    elif kind == "ties":  # a few distinct values: every cut lies inside a run of equal logits
        z = torch.randint(0, 5, (6, V), generator=g).float()
    elif kind == "peaked":
        z[:, 3] = 40.0
    elif kind == "neg_inf":
        z[:, ::3] = -math.inf
        z[0] = -math.inf
    elif kind == "bin_edges":  # values on the bins' grid, so rounding decides each edge
        z = torch.randint(0, 2048, (6, V), generator=g).float() / 2047.0 * 9.0
    return z


def masses_at(z: torch.Tensor, theta: torch.Tensor, cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64 over {z ≥ θ}: the mass of the tokens above the cut, and with the tokens tied at it, [C] each."""
    q = torch.softmax(z.double().masked_fill(z < theta, -math.inf), dim=-1).nan_to_num(0.0)
    cut = cut.double()
    return (q * (z > cut)).sum(-1), (q * (z >= cut)).sum(-1)


@pytest.mark.parametrize("kind", ("normal", "wide", "ties", "peaked", "neg_inf", "bin_edges"))
@pytest.mark.parametrize("top_p", (0.1, 0.7, 0.95))
@pytest.mark.parametrize("V", (4099, 65537))
def test_scan_keeps_the_rules_set(kind, top_p, V):
    """The scan's cut is the rule's: the mass above it is below top_p and reaches it with its ties. Where the
    float64 walk's cut is clear of rounding (its masses 1e-5 away from top_p), the scan's is that same value."""
    z = rows_of(kind, V)
    top = z.amax(-1, keepdim=True)
    for theta in (torch.full((6, 1), -math.inf), top - 2.0):  # alone, and after min-p's cut
        got = top_p_scan(z, top_p, theta, top, Scratch(6, V, z.dtype, z.device))[:, 0]
        want = _top_p_cut(z.double(), top_p, theta.double(), None, 0, RowReduce(V))[:, 0]
        live = z.amax(-1) > -math.inf  # a row of -inf keeps nothing: both give +inf
        assert torch.equal(got[~live], want[~live].float())
        above, through = masses_at(z, theta, got[:, None])
        assert (above[live] < top_p + 1e-5).all() and (through[live] >= top_p - 1e-5).all(), (kind, got)
        want_above, want_through = masses_at(z, theta, want[:, None])
        clear = live & (top_p - want_above > 1e-5) & (want_through - top_p > 1e-5)
        assert torch.equal(got[clear], want[clear].float()), (kind, top_p, got, want)


def test_thresholds_mark_rows_with_nan_and_masking_leaves_them_whole():
    z = rows_of("normal", 257)
    z[2, 5] = math.nan
    theta = thresholds(z, Replay(top_p=0.5, min_p=0.01), RowReduce(257), Scratch(6, 257, z.dtype, z.device))
    assert theta[2].isnan().all() and not theta[[0, 1, 3, 4, 5]].isnan().any()
    masked = fill_below_(z.clone(), theta)
    assert masked[2].isnan().sum() == 1 and (masked[2] > -math.inf).sum() == 256
    assert torch.equal(masked[0] > -math.inf, z[0] >= theta[0])


def test_keep_ids_keeps_exactly_the_ids():
    z = rows_of("normal", 11)
    ids = torch.tensor([[0, 3, -1, -1], [0, 0, 10, -1], [5, -1, -1, -1], [1, 2, 3, 4], [-1] * 4, [10, 11, 0, 7]])
    masked = keep_ids_(z.clone(), ids)
    keep = torch.zeros(6, 12, dtype=torch.bool).scatter_(1, ids.clamp(min=0).masked_fill(ids < 0, 11), True)[:, :11]
    assert torch.equal(masked, z.masked_fill(~keep, -math.inf))

"""The rollout correction across ranks (gloo, CPU, one spawn of 2 ranks): batch-normalised IS weights of a batch
split over data-parallel ranks are the whole batch's, as verl's own helper all-reduces them on the same ranks; and
the losses of a vocabulary-sharded lm_head / logits under a correction (formed from the inputs, from the policy's
log-probs, packed) equal one process on the whole vocabulary: loss, every metric and gradient."""

import pytest
import torch
import torch.distributed as dist

import grpo_kernels as gk
from grpo_kernels.losses.mismatch import rollout_correction
from grpo_kernels.rollout_correction import RolloutCorrection
from tests.conftest import assert_close
from tests.rendezvous import run_rank, spawn_ranks

F32, F64 = torch.float32, torch.float64
B, T, V, H = 6, 5, 37, 8
SHARDS = [slice(0, 20), slice(20, V)]  # uneven vocabulary shards
LENGTHS = [5, 3, 0, 4, 1, 5]  # one empty row
LOGP_SCALE = 5.0  # the log-probs' magnitude in these cases (V = 37: about log 37 ± a few)
CORRECTIONS = {  # name -> (correction fields, loss options)
    "decoupled": (
        dict(
            rollout_is="sequence",
            rollout_is_threshold="0.5_2.0",
            rollout_is_batch_normalize=True,
            rollout_rs="seq_mean_k3,token_k1",
            rollout_rs_threshold="0.05,0.6_1.6",
        ),
        dict(loss_type="dapo", entropy_coef=0.01, with_entropy=True),
    ),
    "bypass": (
        dict(
            rollout_is="token",
            rollout_is_batch_normalize=True,
            rollout_rs="seq_max_k2",
            rollout_rs_threshold=0.05,
            bypass_mode=True,
        ),
        dict(loss_type="gpg"),
    ),
    "ipo": (dict(ipo_threshold=0.05, log_ratio_penalty=0.01, geo_mask="0.8_1.25"), dict(loss_type="dapo")),
}


def _inputs(seed: int = 0) -> dict:
    """Hidden states, lm_head, and the old / sampler log-probs near the policy's own (some tokens rejected)."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None])[..., 0]  # [B, T]
    old = logp + 0.1 * torch.randn(B, T, generator=g)
    return dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        mask=torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None],
        advantages=torch.randn(B, generator=g),
        old_logp=old,
        sampling_logp=old + 0.25 * torch.randn(B, T, generator=g),
    )


def _side(x: dict, bypass: bool, packed: bool) -> dict:
    side = dict(
        advantages=x["advantages"],
        old_logp=None if bypass else x["old_logp"],
        mask=x["mask"],
        sampling_logp=x["sampling_logp"],
    )
    if not packed:
        return side
    keep = x["mask"]
    lengths = torch.tensor(LENGTHS)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return {k: v if v is None or k == "advantages" else v[keep] for k, v in side.items()} | dict(cu_seqlens=cu_seqlens)


def _cases():
    """(name, packed, backend) of every sharded-loss check."""
    cases = [(name, False, "torch") for name in CORRECTIONS]
    return [*cases, ("decoupled", True, "torch"), ("decoupled", False, "triton")]


def _losses(x: dict, name: str, packed: bool, backend: str, cols: slice | None = None, group=None) -> dict:
    """grpo_loss (logits; torch backend) and fused_linear_grpo_loss of case `name`, on the vocabulary `cols` (all of
    it without a group): their losses, metrics and gradients, detached."""
    fields, options = CORRECTIONS[name]
    correction = RolloutCorrection(**fields)
    side = _side(x, correction.bypass_mode, packed)
    keep = x["mask"] if packed else slice(None)
    hidden, targets = x["hidden"][keep], x["targets"][keep]
    cols = cols or slice(None)
    kw = dict(backend=backend, process_group=group, rollout_correction=correction, **side, **options)
    found = {}
    if backend == "torch":  # the Triton interpreter's time goes to the fused route, the one its epilogue serves
        logits = (hidden @ x["weight"][cols].T).requires_grad_()
        out = gk.grpo_loss(logits, targets, inplace=False, **kw)
        found["logits"] = (out.loss, out.metrics, torch.autograd.grad(out.loss, [logits]))
    h, w = hidden.clone().requires_grad_(), x["weight"][cols].clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(h, w, targets, **kw)
    found["fused"] = (out.loss, out.metrics, torch.autograd.grad(out.loss, [h, w]))
    return {
        route: (loss.detach(), {k: v.detach() for k, v in metrics.items()}, [d.detach() for d in grads])
        for route, (loss, metrics, grads) in found.items()
    }


def _references() -> dict:
    """One process on the whole vocabulary and the whole batch (no process group): what each rank compares with."""
    x = _inputs()
    found = {case: _losses(x, *case) for case in _cases() if case[2] == "torch"}  # Triton's: the torch backend's
    for level in ("token", "sequence"):
        correction = RolloutCorrection(rollout_is=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
        whole = rollout_correction(x["old_logp"].double(), x["sampling_logp"].double(), x["mask"], correction)
        found[level] = (whole.weights, whole.metrics["rollout_corr/rollout_is_batch_norm_factor"])
    return found


def _check_batch_normalisation(rank: int, reference: dict) -> None:
    """Rank r holds half the rows: its weights and batch factor are verl's helper's on the same rows and ranks
    (float64, 1e-12), and the whole batch's (to the 1e-8 that a single process's mean adds to its count)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    x = _inputs()
    rows = slice(0, 3) if rank == 0 else slice(3, B)
    old, sampling, mask = x["old_logp"][rows].double(), x["sampling_logp"][rows].double(), x["mask"][rows]
    for level in ("token", "sequence"):
        fields = dict(rollout_is=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
        ours = rollout_correction(old, sampling, mask, RolloutCorrection(**fields))
        weights, _, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old, rollout_log_prob=sampling, response_mask=mask.double(), **fields
        )
        factor = ours.metrics["rollout_corr/rollout_is_batch_norm_factor"]
        torch.testing.assert_close(
            factor.item(), metrics["rollout_corr/rollout_is_batch_norm_factor"], rtol=1e-12, atol=0
        )
        torch.testing.assert_close(
            ours.weights[mask], weights.batch["rollout_is_weights"][mask], rtol=1e-12, atol=1e-12
        )
        whole_weights, whole_factor = reference[level]
        torch.testing.assert_close(factor, whole_factor, rtol=1e-8, atol=0)
        torch.testing.assert_close(ours.weights[mask], whole_weights[rows][mask], rtol=1e-8, atol=0)


def _check_sharded_losses(rank: int, references: dict) -> None:
    x = _inputs()
    for case in _cases():
        ours = _losses(x, *case, cols=SHARDS[rank], group=dist.group.WORLD)
        name, packed, backend = case
        for route in ours:
            loss, metrics, grads = references[name, packed, "torch"][route]
            where = f"{name} packed={packed} {backend} {route}"
            mine_loss, mine_metrics, mine_grads = ours[route]
            assert_close(mine_loss, loss, F32, f"{where} loss")
            assert mine_metrics.keys() == metrics.keys(), where
            for metric, value in metrics.items():
                if "log_ppl_diff" in metric or "log_ppl_abs_diff" in metric:  # a difference of mean log-probs:
                    # float32's error is that of the log-probs (|log p| up to ~5 here), not of their small difference
                    error = (mine_metrics[metric] - value).abs().item()
                    assert error <= 1e-5 * LOGP_SCALE, f"{where} {metric}: error {error:.3g}"
                else:
                    assert_close(mine_metrics[metric], value, F32, f"{where} {metric}")
            if route == "logits":
                grads = [grads[0][..., SHARDS[rank]]]
            else:
                grads = [grads[0], grads[1][SHARDS[rank]]]  # dH whole (the ranks' shares summed inside), dW shard
            for i, (mine, expected) in enumerate(zip(mine_grads, grads, strict=True)):
                assert_close(mine, expected, F32, f"{where} grad {i}")


def _worker(rank: int, store: str, queue, references: dict) -> None:
    def checks() -> None:
        _check_batch_normalisation(rank, references)
        _check_sharded_losses(rank, references)

    run_rank(rank, 2, store, queue, checks)


def test_two_ranks():
    pytest.importorskip("verl", reason='verl is not installed: pip install "grpo-kernels[verl]"')
    spawn_ranks(_worker, 2, _references())

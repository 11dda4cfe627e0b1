"""Vocabulary-parallel passes and sequences split across ranks (gloo, CPU) against one process on the whole thing.

Each spawned run batches every check (spawning is the slow part): its ranks compute the sharded or split result and
compare it with the 1-process result on the whole weight / batch (computed once in the test process for the
rank-independent checks, by the ranks themselves for the others), and report the first mismatch.
"""

import traceback

import pytest
import torch
import torch.distributed as dist

import grpo_kernels as gk
from grpo_kernels.integrations import verl as gk_verl
from grpo_kernels.kernels import parallel
from tests.conftest import assert_close
from tests.rendezvous import join, spawn_ranks

F32 = torch.float32
V, H, B, T = 37, 8, 3, 5  # V divisible by neither 2 nor 4
SHARDS = {2: [20, 17], 4: [11, 9, 7, 10]}  # uneven shard sizes, summing to V
LENGTHS = [5, 7, 4]  # packed sequences (cu_seqlens)
LOSSES = {
    "dapo": dict(loss_type="dapo", epsilon_high=0.28, beta=0.04, with_entropy=True),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", entropy_coef=0.01),
}


def _inputs(packed: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lead = (sum(LENGTHS),) if packed else (B, T)
    S = len(LENGTHS) if packed else B
    mask = torch.rand(lead, generator=g) > 0.25
    mask.view(-1)[0] = True
    return dict(
        hidden=torch.randn(*lead, H, generator=g),
        weight=torch.randn(V, H, generator=g) / H**0.5,
        bias=torch.randn(V, generator=g),
        targets=torch.randint(0, V, lead, generator=g),
        mask=mask,
        advantages=torch.randn(S, generator=g),
        old_logp=torch.randn(lead, generator=g) * 0.2 - 3.0,
        ref_logp=torch.randn(lead, generator=g) * 0.2 - 3.0,
        cu_seqlens=torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()]) if packed else None,
    )


def _shard(world: int, rank: int) -> slice:
    sizes = SHARDS[world]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _grads(out, leaves, seed: int = 1):
    """Gradients of a fixed random objective of `out` (a tensor or tuple of tensors) w.r.t. `leaves`."""
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    objective = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    return torch.autograd.grad(objective, leaves)


def _logprobs_reference(backend) -> dict:
    """One process on the whole logits / weight: token_logprobs' and fused_linear_token_logprobs' outputs and
    gradients (they do not depend on the ranks: computed once, in the test process)."""
    x = _inputs(False)
    logits = (x["hidden"] @ x["weight"].T).requires_grad_()
    kw = dict(with_entropy=True, temperature=0.7, final_logit_softcapping=3.0, mask=x["mask"], backend=backend)
    full = gk.token_logprobs(logits, x["targets"], inplace=False, **kw)
    (d_full,) = _grads(full, [logits])
    h, w, b = (x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    kw = dict(bias=b, with_entropy=True, mask=x["mask"], backend=backend, chunk_size=4)
    fused = gk.fused_linear_token_logprobs(h, w, x["targets"], **kw)
    d_fused = _grads(fused, [h, w, b])
    return {"token": [t.detach() for t in (*full, d_full)], "fused": [t.detach() for t in (*fused, *d_fused)]}


def _check_logprobs(world, rank, backend, reference):
    cols, x = _shard(world, rank), _inputs(False)
    logits = x["hidden"] @ x["weight"].T
    kw = dict(with_entropy=True, temperature=0.7, final_logit_softcapping=3.0, mask=x["mask"], backend=backend)
    logp, entropy, d_full = reference["token"]
    part = logits[..., cols].clone().requires_grad_()
    ours = gk.token_logprobs(part, x["targets"], process_group=dist.group.WORLD, inplace=False, **kw)
    (d_ours,) = _grads(ours, [part])
    pairs = (("logp", ours[0], logp), ("entropy", ours[1], entropy), ("dlogits", d_ours, d_full[..., cols]))
    for name, a, b in pairs:
        assert_close(a, b, F32, f"token_logprobs {backend} {name}")

    h = x["hidden"].clone().requires_grad_()
    kw = dict(with_entropy=True, mask=x["mask"], backend=backend, chunk_size=4)
    logp, entropy, d_h, d_w, d_b = reference["fused"]
    ws, bs = x["weight"][cols].clone().requires_grad_(), x["bias"][cols].clone().requires_grad_()
    ours = gk.fused_linear_token_logprobs(h, ws, x["targets"], process_group=dist.group.WORLD, bias=bs, **kw)
    d_ours = _grads(ours, [h, ws, bs])
    pairs = (("logp", ours[0], logp), ("entropy", ours[1], entropy), ("dH", d_ours[0], d_h))
    pairs += (("dW shard", d_ours[1], d_w[cols]), ("db shard", d_ours[2], d_b[cols]))
    for name, a, b in pairs:
        assert_close(a, b, F32, f"fused_linear_token_logprobs {backend} {name}")
    padded = torch.zeros(max(SHARDS[world]), H)  # gloo gathers equal sizes
    padded[: d_ours[1].shape[0]] = d_ours[1]
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    dw = torch.cat([part[:n] for part, n in zip(parts, SHARDS[world], strict=True)])
    assert_close(dw, d_w, F32, "dW shards concatenated")


def _check_hard_cases(world, rank, backend):
    """-inf logits (a row whose whole shard on rank 0 is -inf, a -inf target logit), a non-contiguous shard view,
    bf16 logits, and a masked row, against one process on the whole logits."""
    cols, x = _shard(world, rank), _inputs(False, seed=5)
    logits = x["hidden"] @ x["weight"].T  # [B, T, V]
    logits[0, 0, _shard(world, 0)] = float("-inf")
    logits[1, 2, x["targets"][1, 2]] = float("-inf")
    logits[2, 1, 3] = float("-inf")
    mask = x["mask"].clone()
    mask[1, :] = False
    mask[0, 0] = mask[1, 2] = True
    for dtype in (F32, torch.bfloat16) if backend == "torch" else (F32,):
        kw = dict(with_entropy=True, mask=mask, backend=backend, inplace=False)
        whole = logits.to(dtype).requires_grad_()
        full = gk.token_logprobs(whole, x["targets"], **kw)
        (d_full,) = _grads((full[0].nan_to_num(neginf=0.0), full[1]), [whole])
        part = logits.to(dtype)[..., cols].requires_grad_()  # a non-contiguous view of the whole logits
        ours = gk.token_logprobs(part, x["targets"], process_group=dist.group.WORLD, **kw)
        (d_ours,) = _grads((ours[0].nan_to_num(neginf=0.0), ours[1]), [part])
        assert ours[0][1, 2] == float("-inf")
        for name, a, b in (("logp", ours[0], full[0]), ("entropy", ours[1], full[1])):
            assert_close(a.nan_to_num(neginf=0.0), b.nan_to_num(neginf=0.0), dtype, f"hard {backend} {dtype} {name}")
        assert_close(d_ours.float(), d_full[..., cols].float(), dtype, f"hard {backend} {dtype} dlogits")


def _side(x: dict) -> dict:
    return {k: x[k] for k in ("advantages", "old_logp", "ref_logp", "mask")} | {"cu_seqlens": x["cu_seqlens"]}


def _losses_reference(backend) -> dict:
    """(packed, loss name) -> one process on the whole logits / weight: grpo_loss's loss, metrics and dlogits, and
    fused_linear_grpo_loss's loss, metrics, dH and dW (they do not depend on the ranks: computed once)."""
    reference = {}
    for packed in (False, True):
        x = _inputs(packed)
        side = _side(x)
        for name, options in LOSSES.items():
            logits = (x["hidden"] @ x["weight"].T).requires_grad_()
            full = gk.grpo_loss(logits, x["targets"], inplace=False, backend=backend, **side, **options)
            (d_full,) = torch.autograd.grad(full.loss, [logits])
            h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
            fused = gk.fused_linear_grpo_loss(h, w, x["targets"], backend=backend, **side, **options)
            d_fused = torch.autograd.grad(fused.loss, [h, w])
            reference[packed, name] = {
                "logits": (full.loss.detach(), {k: v.detach() for k, v in full.metrics.items()}, d_full),
                "fused": (fused.loss.detach(), {k: v.detach() for k, v in fused.metrics.items()}, *d_fused),
            }
    return reference


def _check_losses(world, rank, backend, reference):
    cols = _shard(world, rank)
    for packed in (False, True):
        x = _inputs(packed)
        side = _side(x)
        for name, options in LOSSES.items():
            where = f"{backend} {name} packed={packed}"
            loss, metrics, d_full = reference[packed, name]["logits"]
            part = (x["hidden"] @ x["weight"].T)[..., cols].clone().requires_grad_()
            ours = gk.grpo_loss(
                part, x["targets"], inplace=False, backend=backend, process_group=dist.group.WORLD, **side, **options
            )
            (d_ours,) = torch.autograd.grad(ours.loss, [part])
            assert_close(ours.loss, loss, F32, f"grpo_loss {where} loss")
            assert ours.metrics.keys() == metrics.keys()
            for metric in metrics:
                assert_close(ours.metrics[metric], metrics[metric], F32, f"grpo_loss {where} {metric}")
            assert_close(d_ours, d_full[..., cols], F32, f"grpo_loss {where} dlogits")

            loss, metrics, d_h, d_w = reference[packed, name]["fused"]
            h, ws = x["hidden"].clone().requires_grad_(), x["weight"][cols].clone().requires_grad_()
            ours = gk.fused_linear_grpo_loss(
                h, ws, x["targets"], backend=backend, process_group=dist.group.WORLD, **side, **options
            )
            d_ours = torch.autograd.grad(ours.loss, [h, ws])
            assert_close(ours.loss, loss, F32, f"fused_linear_grpo_loss {where} loss")
            for metric in metrics:
                assert_close(ours.metrics[metric], metrics[metric], F32, f"fused_linear {where} {metric}")
            assert_close(d_ours[0], d_h, F32, f"fused_linear_grpo_loss {where} dH")
            assert_close(d_ours[1], d_w[cols], F32, f"fused_linear_grpo_loss {where} dW shard")


def _check_verl(world, rank):
    """verl's meaning of dist_process_group: equal shards at rank · V_r, whole logp / entropy, this rank's dH share."""
    x = _inputs(False)
    per = 9  # 9 · world rows of the weight: verl shards evenly
    weight = x["weight"][: per * world]
    targets = x["targets"] % (per * world)
    h, w = x["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
    full = gk_verl.linear_cross_entropy(h, w, targets, 0.8)
    d_full = _grads(full, [h, w])
    hs, ws = x["hidden"].clone().requires_grad_(), weight[rank * per : (rank + 1) * per].clone().requires_grad_()
    ours = gk_verl.linear_cross_entropy(hs, ws, targets, 0.8, "none", dist.group.WORLD)
    d_ours = _grads(ours, [hs, ws])
    assert_close(ours[0], full[0], F32, "verl logprobs")
    assert_close(ours[1], full[1], F32, "verl entropy")
    assert_close(d_ours[1], d_full[1][rank * per : (rank + 1) * per], F32, "verl dW shard")
    d_hidden = d_ours[0].clone()
    dist.all_reduce(d_hidden)  # what Megatron's sequence-parallel region does with verl's partial dH
    assert_close(d_hidden, d_full[0], F32, "verl dH summed over ranks")


def _check_bytes(world, rank, monkeypatch_bytes):
    """Bytes each call sends through collectives, against the module docstring's formula."""
    x = _inputs(False)
    cols = _shard(world, rank)
    logits = (x["hidden"] @ x["weight"].T)[..., cols].contiguous().requires_grad_()
    for with_entropy in (False, True):
        monkeypatch_bytes.clear()
        out = gk.token_logprobs(
            logits, x["targets"], with_entropy=with_entropy, inplace=False, process_group=dist.group.WORLD
        )
        assert sum(monkeypatch_bytes) == 16 * world + 4 * (3 + with_entropy) * B * T, monkeypatch_bytes
        monkeypatch_bytes.clear()
        _grads(out, [logits])
        assert sum(monkeypatch_bytes) == 0  # the logits' backward is local
    M = int(x["mask"].sum())
    h, ws = x["hidden"].clone().requires_grad_(), x["weight"][cols].clone().requires_grad_()
    monkeypatch_bytes.clear()
    out = gk.fused_linear_token_logprobs(
        h, ws, x["targets"], mask=x["mask"], with_entropy=True, process_group=dist.group.WORLD
    )
    assert sum(monkeypatch_bytes) == 16 * world + 4 * 4 * M, monkeypatch_bytes
    monkeypatch_bytes.clear()
    _grads(out, [h, ws])
    assert sum(monkeypatch_bytes) == H * 4 * M  # the dH all-reduce, [M, H] float32


def _split_sequences(x: dict, world: int, rank: int) -> tuple[dict, torch.Tensor]:
    """This rank's tokens of every packed sequence (rank r of R: the r-th of R near-equal pieces of each sequence),
    as packed inputs with their own cu_seqlens; and the tokens' indices in the whole batch."""
    index, lengths, start = [], [], 0
    for n in LENGTHS:
        bounds = [start + n * r // world for r in range(world + 1)]
        index.append(torch.arange(bounds[rank], bounds[rank + 1]))
        lengths.append(bounds[rank + 1] - bounds[rank])
        start += n
    index = torch.cat(index)
    local = {k: x[k][index] for k in ("targets", "mask", "old_logp", "ref_logp")}
    local["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return local | {"advantages": x["advantages"]}, index


def _check_sequence_split(world, rank):
    """GSPO and VESPO on sequences split over the ranks: the ranks' losses sum to the unsplit loss, every token
    gets its unsplit gradient, and the metrics are the unsplit ones."""
    x = _inputs(True, seed=3)
    logits_all = x["hidden"] @ x["weight"].T  # [N, V]
    side = {k: x[k] for k in ("targets", "mask", "old_logp", "ref_logp", "advantages", "cu_seqlens")}
    local, index = _split_sequences(x, world, rank)
    for name, options in {
        "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04, with_entropy=True),
        "vespo": dict(loss_type="vespo", top_entropy_quantile=0.5),
    }.items():
        logits = logits_all.clone().requires_grad_()
        full = gk.grpo_loss(logits, inplace=False, **side, **options)
        (d_full,) = torch.autograd.grad(full.loss, [logits])
        part = logits_all[index].clone().requires_grad_()
        ours = gk.grpo_loss(part, inplace=False, sequence_group=dist.group.WORLD, **local, **options)
        (d_ours,) = torch.autograd.grad(ours.loss, [part])
        total = ours.loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total, full.loss, F32, f"{name} split loss")
        assert_close(d_ours, d_full[index], F32, f"{name} split dlogits")
        for metric in full.metrics:
            assert_close(ours.metrics[metric], full.metrics[metric], F32, f"{name} split {metric}")
        h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
        full = gk.fused_linear_grpo_loss(h, w, **side, **options)
        d_full = torch.autograd.grad(full.loss, [h, w])
        hs, ws = x["hidden"][index].clone().requires_grad_(), x["weight"].clone().requires_grad_()
        ours = gk.fused_linear_grpo_loss(hs, ws, sequence_group=dist.group.WORLD, **local, **options)
        d_ours = torch.autograd.grad(ours.loss, [hs, ws])
        total, d_weight = ours.loss.detach().clone(), d_ours[1].clone()
        dist.all_reduce(total)
        dist.all_reduce(d_weight)  # what data / context parallel training sums
        assert_close(total, full.loss, F32, f"{name} split fused loss")
        assert_close(d_ours[0], d_full[0][index], F32, f"{name} split fused dH")
        assert_close(d_weight, d_full[1], F32, f"{name} split fused dW summed")


def _worker(rank: int, store: str, queue, world: int, checks: tuple[str, ...], references: dict) -> None:
    join(rank, world, store)
    sent: list[int] = []
    try:
        for check in checks:
            if check == "bytes":
                _with_byte_count(sent, lambda: _check_bytes(world, rank, sent))
            elif check == "verl":
                _check_verl(world, rank)
            elif check == "split":
                _check_sequence_split(world, rank)
            elif check.startswith("hard:"):
                _check_hard_cases(world, rank, check.split(":")[1])
            else:
                kind, backend = check.split(":")
                {"logprobs": _check_logprobs, "losses": _check_losses}[kind](world, rank, backend, references[check])
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001  reported to the test, which fails with it
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _with_byte_count(sent: list[int], fn) -> None:
    """Run fn with dist.all_reduce / all_gather recording the bytes of each call in `sent`."""
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counted_reduce(x, *args, **kwargs):
        sent.append(x.numel() * x.element_size())
        return all_reduce(x, *args, **kwargs)

    def counted_gather(parts, x, *args, **kwargs):
        sent.append(sum(p.numel() * p.element_size() for p in parts))
        return all_gather(parts, x, *args, **kwargs)

    dist.all_reduce, dist.all_gather = counted_reduce, counted_gather
    try:
        fn()
    finally:
        dist.all_reduce, dist.all_gather = all_reduce, all_gather


def _spawn(world: int, checks: tuple[str, ...], references: dict) -> None:
    spawn_ranks(_worker, world, world, checks, references)


@pytest.fixture(scope="module")
def references() -> dict:
    """ "logprobs:<backend>" / "losses:<backend>" -> the 1-process results every rank compares with, computed once
    here rather than on every rank of every launch (the Triton interpreter makes them the slow part)."""
    found = {f"logprobs:{b}": _logprobs_reference(b) for b in ("torch", "triton")}
    return found | {f"losses:{b}": _losses_reference(b) for b in ("torch", "triton")}


def test_two_ranks(references):
    """2 ranks: both backends, both loss kinds with and without cu_seqlens, verl's drop-in, the bytes, the split."""
    checks = ("logprobs:torch", "logprobs:triton", "hard:torch", "hard:triton", "losses:torch", "losses:triton")
    _spawn(2, (*checks, "verl", "bytes", "split"), references)


def test_four_ranks(references):
    _spawn(4, ("logprobs:torch", "logprobs:triton", "losses:torch", "losses:triton", "bytes"), references)


def test_shard_layout_errors(monkeypatch):
    """Shards that do not tile the vocabulary, and a vocab_start without a group, are errors naming vocab_start."""
    with pytest.raises(ValueError, match="vocab_start"):
        parallel.vocab_shard(None, 10, 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")

    def gather(layout):
        def fake(parts, mine, group=None):
            for part, row in zip(parts, layout, strict=True):
                part.copy_(torch.tensor(row))

        return fake

    monkeypatch.setattr(dist, "all_gather", gather([[0, 10], [12, 5]]))
    with pytest.raises(ValueError, match="vocab_start.*gaps"):
        parallel.vocab_shard(object(), 10, 0)
    monkeypatch.setattr(dist, "all_gather", gather([[-1, 10], [-1, 5]]))
    shard = parallel.vocab_shard(object(), 10, None)
    assert (shard.start, shard.size, shard.vocab) == (0, 10, 15)
    with pytest.raises(ValueError, match="stats"):
        parallel.vocab_shard(object(), 10, None, ("is_top1",))

"""Padding-free training: on tiny Llama and Qwen2 models built from a config, the packed passes (one row of every
sequence's real tokens, positions restarting per sequence) give the padded passes' log-probs, loss and parameter
gradients; micro-batches filled by a token budget make the one-batch update; the attention backend is chosen as
documented; a model that would attend across packed sequences is detected."""

import dataclasses
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from grpo_kernels.integrations.attention import (  # noqa: E402
    VARLEN_SDPA,
    packing_support,
    resolve_attn_implementation,
    set_attn_implementation,
)
from grpo_kernels.integrations.hf import policy_logprobs  # noqa: E402
from grpo_kernels.options import LossOptions  # noqa: E402
from grpo_kernels.packing import PackedSequences  # noqa: E402
from grpo_kernels.trainer import TrainConfig  # noqa: E402
from grpo_kernels.trainer.logging import TIMES  # noqa: E402
from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch, token_budget_groups  # noqa: E402
from grpo_kernels.trainer.update import inner_updates  # noqa: E402
from tests.conftest import assert_close  # noqa: E402
from tests.test_hf import MODELS as HF_MODELS  # noqa: E402
from tests.test_hf import VOCAB, P, T  # noqa: E402

B = 5
MODELS = {"llama": HF_MODELS["llama_tied"], "qwen2": HF_MODELS["qwen2"]}  # test_hf's tiny models, built from configs
LOSSES = {  # a token-level and a sequence-level loss type, and the normaliser that reads T
    "dapo": dict(loss_type="dapo", epsilon_high=0.28, beta=0.04),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),  # TRL's GSPO
    "grpo_token_sum_norm": dict(loss_type="grpo", loss_agg_mode="seq-mean-token-sum-norm"),
}


def model(name: str, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    m = MODELS[name]()
    set_attn_implementation(m, attn)
    return m


def update_batch(seed: int = 0) -> UpdateBatch:
    """TRL's layout with every kind of padding: left-padded prompts, completions that end early, a completion token
    dropped by the mask only, a row without completion tokens."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (B, P + T), generator=g)
    attention_mask = torch.ones(B, P + T, dtype=torch.long)
    attention_mask[0, :2] = 0  # a short prompt
    attention_mask[1, P + 3 :] = 0  # a completion of 3 tokens
    attention_mask[3, :1] = 0
    attention_mask[3, P + 1 :] = 0
    attention_mask[4, P:] = 0  # no completion at all
    completion_mask = attention_mask[:, P:].bool().clone()
    completion_mask[2, 2] = False  # the model sees it, the loss drops it
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)  # pad id
    old = (torch.randn(B, T, generator=g) * 0.1 - 4.6).masked_fill(~completion_mask, 0.0)
    return UpdateBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=g),
        old_logp=old,
        ref_logp=(old + 0.05 * torch.randn(B, T, generator=g)).masked_fill(~completion_mask, 0.0),
        is_ratio=torch.rand(B, generator=g) + 0.5,
        token_weights=torch.rand(B, T, generator=g) + 0.5,
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_packed_logprobs_equal_padded(name, attn):
    m = model(name, attn).eval()
    batch = update_batch()
    with torch.no_grad():
        padded = PolicyModule(m).logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, 0.8)
        packed = PolicyModule(m, padding_free=True).logprobs(
            batch.input_ids, batch.attention_mask, batch.completion_mask, 0.8
        )
        layout = PackedSequences.from_padded(batch.input_ids, batch.attention_mask, T)
        direct = policy_logprobs(m, layout, temperature=0.8)  # [N]: the helper on the packed layout
    assert layout.input_ids.numel() == int(batch.attention_mask.sum())  # not one padding token
    for got, want, what in zip(packed, padded, ("logp", "entropy"), strict=True):
        assert got.shape == want.shape == (B, T)
        assert_close(got, want, torch.float32, what)
    kept = layout.pack(batch.completion_mask)  # [N]: the helper scores every completion token, kept or not
    assert_close(direct[kept], padded[0][batch.completion_mask], torch.float32, "packed helper")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", MODELS)
def test_packed_loss_and_gradients_equal_padded(name, loss):
    batch = update_batch(1)
    results = []
    for padding_free in (False, True):
        policy = PolicyModule(model(name), padding_free)
        value, metrics = policy(batch, LossOptions(**LOSSES[loss], max_completion_length=T))
        value.backward()
        results.append((value, metrics, {n: p.grad for n, p in policy.named_parameters()}))
    (want, want_metrics, want_grads), (got, got_metrics, got_grads) = results
    assert_close(got, want, torch.float32, "loss")
    assert got_metrics.keys() == want_metrics.keys()
    for key in want_metrics:
        assert_close(torch.as_tensor(got_metrics[key]), torch.as_tensor(want_metrics[key]), torch.float32, key)
    assert max(g.abs().max() for g in want_grads.values()) > 0
    for n, grad in want_grads.items():
        assert_close(got_grads[n], grad, torch.float32, f"grad {n}")


def sgd_step(batch: UpdateBatch, loss: dict, padding_free: bool, **split) -> tuple[float, list[torch.Tensor]]:
    policy = PolicyModule(model("llama"), padding_free)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    options = LossOptions(**loss, max_completion_length=T)
    stats = inner_updates(policy, optimizer, batch, options=options, num_iterations=1, max_grad_norm=1e9, **split)
    return stats["loss"], [p.detach().clone() for p in policy.parameters()]


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize(
    "loss",
    [
        dict(loss_type="grpo", beta=0.04),  # per-row normaliser
        dict(loss_type="bnpo"),  # the batch's token mean
        dict(loss_type="dapo", epsilon_high=0.28),  # num_items_in_batch
        dict(loss_type="grpo", loss_agg_mode="seq-mean-token-mean"),  # num_sequences_in_batch
    ],
    ids=["grpo", "bnpo", "dapo", "seq_mean"],
)
def test_token_budget_micro_batches_equal_one_batch(loss, padding_free):
    """A 12-token budget splits the 5 rows unevenly (packed: rows of 8, 9, 10, 5 and 3 real tokens); the update is
    the one-batch update, for every kind of normaliser."""
    batch = update_batch(2)
    budget = 12 if padding_free else 2 * (P + T)
    costs = batch.token_costs(padding_free)
    groups = token_budget_groups(costs, budget)
    assert len({len(g) for g in groups}) > 1, f"the split {groups} is even: the test would prove less"
    want_loss, want = sgd_step(batch, loss, padding_free)
    got_loss, got = sgd_step(batch, loss, padding_free, max_tokens_per_microbatch=budget)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_token_budget_groups():
    assert token_budget_groups([8, 9, 10, 5, 3], 12) == [[0], [1], [2], [3, 4]]
    assert token_budget_groups([3, 3, 3, 3], 12) == [[0, 1, 2, 3]]
    assert token_budget_groups([3, 3, 3, 3], 12, parts=3) == [[0], [1], [2, 3]]  # at least `parts`, by tokens
    with pytest.raises(ValueError, match="below row 1's 13 tokens"):
        token_budget_groups([3, 13], 12)
    with pytest.raises(ValueError, match="cannot make 3 micro-batches"):
        token_budget_groups([3, 3], 12, parts=3)


def test_packed_sequences_layout_and_errors():
    packed = PackedSequences.from_sequences([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [2, 1])
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert packed.cu_seqlens.tolist() == [0, 3, 5] and packed.cu_seqlens.dtype == torch.int32
    assert packed.completion_cu_seqlens.tolist() == [0, 2, 3] and packed.targets.tolist() == [6, 7, 9]
    assert packed.max_length == 3
    with pytest.raises(ValueError, match="needs a prompt token"):
        PackedSequences.from_sequences([torch.tensor([5, 6])], [2])
    holes = torch.ones(2, 5, dtype=torch.long)
    holes[1, 2] = 0
    with pytest.raises(ValueError, match=r"one contiguous run of tokens per row .* packed; row 1 has 2"):
        PackedSequences.from_padded(torch.zeros(2, 5, dtype=torch.long), holes, 2)
    batch = update_batch()
    bad = batch.completion_mask.clone()
    bad[1, 5] = True  # beyond the attention mask
    with pytest.raises(ValueError, match="completion_mask keeps a token that attention_mask drops"):
        PolicyModule(model("llama"), padding_free=True).logprobs(batch.input_ids, batch.attention_mask, bad, 1.0)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        policy_logprobs(model("llama"), packed, batch.attention_mask)


def test_attention_choice():
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    m = model("llama", "auto")  # sdpa on CPU: torch's kernel once per packed sequence
    assert m.config._attn_implementation == VARLEN_SDPA
    assert set_attn_implementation(m, "eager") == "eager" and m.config._attn_implementation == "eager"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        resolve_attn_implementation("flash", "cpu")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"needs the flash-attn package.*grpo-kernels\[flash-attn\]"):
            resolve_attn_implementation("flash_attention_2", "cuda")
    else:
        with pytest.raises(ValueError, match="runs on CUDA only"):
            resolve_attn_implementation("flash_attention_2", "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn (the flash-attn extra)")
@pytest.mark.parametrize("name", MODELS)
def test_flash_attention_varlen_equals_padded_sdpa(name):
    """On a GPU with flash-attn, `auto` picks flash_attention_2 and the model runs packed sequences apart; bf16
    log-probs, loss and gradients match the padded sdpa ones (attention across a boundary would not)."""
    batch = UpdateBatch(**{k: None if v is None else v.cuda() for k, v in vars(update_batch()).items()})
    outputs = []
    for attn, padding_free in (("sdpa", False), ("auto", True)):
        m = model(name).cuda().to(torch.bfloat16)
        assert set_attn_implementation(m, attn) == ("flash_attention_2" if attn == "auto" else "sdpa")
        assert packing_support(m) is None
        policy = PolicyModule(m, padding_free)
        logp, _ = policy.logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
        loss, _ = policy(batch, LossOptions(**LOSSES["dapo"]))
        loss.backward()
        outputs.append((logp, loss, [p.grad.float() for p in policy.parameters()]))
    (want_logp, want_loss, want_grads), (got_logp, got_loss, got_grads) = outputs
    assert_close(got_logp.float(), want_logp.float(), torch.bfloat16, "logp")
    assert_close(got_loss.float(), want_loss.float(), torch.bfloat16, "loss")
    for got, want in zip(got_grads, want_grads, strict=True):
        assert_close(got, want, torch.bfloat16, "grad")


def test_packing_support_detects_a_model_that_ignores_positions():
    for name in MODELS:
        assert packing_support(model(name)) is None
    leaky = model("llama")
    forward = leaky.model.forward
    leaky.model.forward = lambda input_ids=None, position_ids=None, **_: forward(input_ids=input_ids, use_cache=False)
    assert "sees its neighbour" in packing_support(leaky)  # one causal sequence of all the tokens
    no_positions = model("llama")
    no_positions.model.forward = lambda input_ids=None, **kwargs: forward(input_ids=input_ids, **kwargs)
    assert "takes no position_ids" in packing_support(no_positions)


def test_demo_packed_and_padded_log_the_same_metrics(tmp_path, capsys):
    """20 demo steps with the same seed, padding-free (the default) and padded: the same rollouts, and metrics equal
    to float error (the two forwards differ by rounding only)."""
    from grpo_kernels.trainer import train

    runs = {}
    for padding_free in (True, False):
        config = dataclasses.replace(
            TrainConfig(),
            output_dir=str(tmp_path / str(padding_free)),
            steps=20,
            checkpoint_every=0,
            eval_every=0,
            progress=False,
            plot=False,
            padding_free=padding_free,
            max_tokens_per_microbatch=200 if padding_free else None,
        )
        runs[padding_free] = train(config)
    assert "padding-free training is off" not in capsys.readouterr().out  # the tiny Llama runs packed
    for packed, padded in zip(runs[True], runs[False], strict=True):
        assert packed.keys() == padded.keys()
        for key in packed:
            if key not in TIMES:
                assert packed[key] == pytest.approx(padded[key], rel=1e-3, abs=1e-5), (packed["step"], key)

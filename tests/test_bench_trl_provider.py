"""The benchmark's TRL 1.16 provider is TRL's loss: its algebra gives `GRPOTrainer._compute_loss`'s own loss and
gradients (TRL's method run on a stand-in trainer), and the whole provider (TRL's fused head + that algebra) equals
`fused_linear_grpo_loss` and the float64 oracle; its log-prob pass equals `fused_linear_token_logprobs`."""

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference
from tests.conftest import assert_close

pytest.importorskip("trl.kernels.chunked_logprob", reason="the TRL provider needs TRL >= 1.16")
from benchmarks import baselines  # noqa: E402

F32 = torch.float32
B, T, H, V = 3, 8, 16, 300
CASES = {  # name -> loss options (TRL's names)
    "dapo": dict(loss_type="dapo", epsilon_high=0.28, beta=0.04),
    "grpo": dict(loss_type="grpo", beta=0.04),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "bnpo_delta_no_bias_correction": dict(loss_type="bnpo", delta=1.5, beta=0.04, use_bias_correction_kl=False),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[:, 0] = True
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    old_logp = logp + 0.3 * torch.randn(B, T, generator=g)  # ratios on both sides of the clip range
    ref_logp = logp + 0.2 * torch.randn(B, T, generator=g)
    advantages = torch.tensor([1.0, -0.7, 0.4])
    return hidden, weight, targets, advantages, old_logp, ref_logp, mask


def _grads(loss, *leaves):
    return torch.autograd.grad(loss, leaves)


def _trl_compute_loss(hidden, weight, targets, advantages, old_logp, ref_logp, mask, **options):
    """TRL's own `GRPOTrainer._compute_loss` on a stand-in trainer whose log-prob pass is TRL's fused head."""
    from trl import GRPOTrainer

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        logp, entropy = baselines.trl_logprobs(hidden, weight, targets, mask)
        return logp, entropy, None

    args = SimpleNamespace(
        use_bias_correction_kl=options.get("use_bias_correction_kl", True),
        delta=options.get("delta"),
        steps_per_generation=1,
    )
    accelerator = SimpleNamespace(
        num_processes=1,
        sync_gradients=True,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        beta=options["beta"],
        loss_type=options["loss_type"],
        epsilon_low=0.2,
        epsilon_high=options.get("epsilon_high", 0.2),
        args=args,
        accelerator=accelerator,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    completion_mask = mask.long()
    inputs = dict(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        completion_ids=targets,
        completion_mask=completion_mask,
        advantages=advantages,
        num_items_in_batch=completion_mask.sum(),
        old_per_token_logps=old_logp,
        ref_per_token_logps=ref_logp,
    )
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("case", CASES)
def test_algebra_is_trls_compute_loss(case):
    hidden, weight, *rest = _inputs()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    expected = _trl_compute_loss(hidden, weight, *rest, **CASES[case])
    actual = baselines.trl_loss(hidden, weight, *rest, **CASES[case])
    assert_close(actual, expected, F32, "loss")
    for name, a, e in zip(
        ("hidden", "weight"), _grads(actual, hidden, weight), _grads(expected, hidden, weight), strict=True
    ):
        assert_close(a, e, F32, f"grad {name}")


@pytest.mark.parametrize("case", CASES)
def test_provider_equals_ours_and_the_oracle(case):
    hidden, weight, targets, advantages, old_logp, ref_logp, mask = _inputs()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    args = (targets, advantages, old_logp, ref_logp, mask)
    trl = baselines.trl_loss(hidden, weight, *args, **CASES[case])
    ours = gk.fused_linear_grpo_loss(hidden, weight, *args, backend="torch", **CASES[case]).loss
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    oracle, _ = reference.grpo_loss(h64 @ w64.T, *args, **CASES[case])
    assert_close(trl, oracle, F32, "loss vs oracle")
    assert_close(trl, ours, F32, "loss vs ours")
    trl_grads, our_grads = _grads(trl, hidden, weight), _grads(ours, hidden, weight)
    for name, t, o, r in zip(("hidden", "weight"), trl_grads, our_grads, _grads(oracle, h64, w64), strict=True):
        assert_close(t, r, F32, f"grad {name} vs oracle")
        assert_close(t, o, F32, f"grad {name} vs ours")


def test_logprob_pass_equals_ours():
    hidden, weight, targets, *_, mask = _inputs()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    trl_logp, trl_entropy = baselines.trl_logprobs(hidden, weight, targets, mask)
    logp, entropy = gk.fused_linear_token_logprobs(
        hidden, weight, targets, mask=mask, with_entropy=True, backend="torch"
    )
    assert_close(trl_logp, logp, F32, "logp")
    assert_close(trl_entropy, entropy, F32, "entropy")
    for name, t, o in zip(
        ("hidden", "weight"), _grads(trl_logp.sum(), hidden, weight), _grads(logp.sum(), hidden, weight), strict=True
    ):
        assert_close(t, o, F32, f"grad {name}")


def test_naive_entropy_is_the_entropy():
    hidden, weight, targets, *_, mask = _inputs()
    logits = hidden @ weight.T  # [B, T, V]
    _, expected = reference.token_logprobs(logits, targets)
    assert_close(baselines.naive_entropy(logits), expected, F32, "entropy")
    assert_close(baselines.naive_logprobs(hidden, weight, targets, mask)[1], expected * mask, F32, "entropy")


def test_report_ratios_against_trl(tmp_path):
    from benchmarks import report

    def case(provider, median, memory):
        info = dict(bench="fused_linear", provider=provider, mode="fwd_bwd", shape="dapo-n2048", N=2048, V=151936)
        info.update(H=896, loss="dapo", device="cpu", torch="2.13", peak_extra_bytes=memory)
        return {"extra_info": info, "stats": {"median": median}}

    path = tmp_path / "out.json"
    path.write_text(json.dumps({"benchmarks": [case("trl", 30.0, 2000 * 2**20), case("torch", 12.0, 600 * 2**20)]}))
    text = report.trl_table(report.load(str(path)))
    assert "| fused lm_head + loss, fwd + bwd · dapo-n2048 | 30,000 ms, 2,000 MiB | 0.40×, 0.30× |" in text


def test_interleaved_command_writes_results(tmp_path):
    from benchmarks import interleaved

    out = interleaved.main(
        ["--size", "smoke", "--rounds", "1", "--benches", "token_logprobs", "--out", str(tmp_path / "r.json")]
    )
    rows = json.loads(out.read_text())["benchmarks"]
    assert {r["extra_info"]["provider"] for r in rows} == {"torch", "trl"}
    assert all(r["extra_info"]["peak_extra_bytes"] > 0 for r in rows)
    assert "Against TRL 1.16" in out.with_suffix(".md").read_text()

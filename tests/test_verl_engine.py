"""The registered losses where verl's workers call them: verl 0.9.1's engine-side `ppo_loss`
(`verl/workers/utils/losses.py`, the loss function its engine workers hand to `forward_backward_batch`), run with
`policy_loss.loss_mode="gk_<type>"` against the same call with verl's own mode, on a tiny unpadded batch: the
policy loss (with verl's entropy bonus and KL loss around it), its gradient w.r.t. the model's log-probs and
entropy, and every metric."""

import pytest
import torch

losses = pytest.importorskip(
    "verl.workers.utils.losses", reason='verl is not installed: pip install "grpo-kernels[verl]"'
)

from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from grpo_kernels.integrations import verl as gk_verl  # noqa: E402
from grpo_kernels.options import LOSS_AGG_MODES  # noqa: E402
from tests.conftest import assert_close  # noqa: E402

F32 = torch.float32
PROMPT_LENGTHS = [3, 1, 2, 4]  # B = 4 sequences, prompts padded to P = 4, responses to T = 5
RESPONSE_LENGTHS = [5, 2, 0, 4]
P, T = 4, 5
# (our registered mode, verl's mode of the same loss, policy_loss fields)
MODES = [
    ("gk_dppo_tv", "dppo_tv", {}),
    ("gk_dppo_kl", "dppo_kl", {}),
    ("gk_dro", "dro", {"dro_beta": 0.7}),
    ("gk_dapo", "vanilla", {}),
]
BATCH_INFO = {"local": dict(dp_size=1, batch_num_tokens=None, global_batch_size=None), "global": None}


@pytest.fixture(scope="module", autouse=True)
def registered():
    names = gk_verl.register()
    yield
    for name in names:
        core_algos.POLICY_LOSS_REGISTRY.pop(name)


def engine_batch(seed: int, batch_info: dict | None, is_weights: bool) -> tuple[dict, TensorDict]:
    """(model_output, data) as verl's engine hands them to `ppo_loss`: log-probs and entropy over every unpadded
    token of prompt + response (the response's log-probs sit one position left), the rest padded [B, T]."""
    g = torch.Generator().manual_seed(seed)
    B = len(PROMPT_LENGTHS)
    prompt_mask = torch.arange(P)[None] >= P - torch.tensor(PROMPT_LENGTHS)[:, None]  # left-padded prompts
    response_mask = torch.arange(T)[None] < torch.tensor(RESPONSE_LENGTHS)[:, None]  # [B, T]
    nnz = sum(PROMPT_LENGTHS) + sum(RESPONSE_LENGTHS)
    log_probs = -(0.1 + 2.0 * torch.rand(nnz, generator=g))  # [nnz], differentiable leaves below
    entropy = 0.5 + torch.rand(nnz, generator=g)  # [nnz]
    old = -(0.1 + 2.0 * torch.rand(B, T, generator=g))  # [B, T]
    data = TensorDict(
        {
            "prompts": torch.zeros(B, P, dtype=torch.long),
            "responses": torch.zeros(B, T, dtype=torch.long),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1).long(),
            "response_mask": response_mask.long(),
            "old_log_probs": old,
            "advantages": torch.randn(B, 1, generator=g).expand(B, T).clone(),
            "ref_log_prob": old + 0.2 * torch.randn(B, T, generator=g),
        },
        batch_size=[B],
    )
    if is_weights:
        data["rollout_is_weights"] = torch.exp(0.3 * torch.randn(B, T, generator=g))
    info = batch_info or dict(dp_size=2, batch_num_tokens=int(response_mask.sum()) + 9, global_batch_size=7)
    tu.assign_non_tensor(data, **info)
    return {"log_probs": log_probs, "entropy": entropy}, data


def run_engine_loss(loss_mode: str, policy: dict, loss_agg_mode: str, batch_info, is_weights: bool):
    """verl's ppo_loss with `loss_mode`: (loss, gradients w.r.t. log-probs and entropy, aggregated metrics)."""
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=0.05,  # DPPO: TV/KL thresholds that mask some tokens of this batch
        clip_ratio_high=0.08,
        clip_ratio_c=1.5,  # DPPO's truncation cap, the clipped surrogate's dual clip
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy),
    )
    model_output, data = engine_batch(0, batch_info, is_weights)
    leaves = [model_output["log_probs"].requires_grad_(), model_output["entropy"].requires_grad_()]
    loss, metrics = losses.ppo_loss(config, model_output, data)
    grads = torch.autograd.grad(loss, leaves)
    values = {k: v.aggregate() if isinstance(v, Metric) else v for k, v in metrics.items()}
    return loss, grads, values


@pytest.mark.parametrize("batch_info", BATCH_INFO)
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("ours,theirs,policy", MODES, ids=[m[0] for m in MODES])
def test_engine_loss_equals_verls_mode(ours, theirs, policy, loss_agg_mode, batch_info):
    for is_weights in (False, True):
        loss, grads, metrics = run_engine_loss(ours, policy, loss_agg_mode, BATCH_INFO[batch_info], is_weights)
        ref_loss, ref_grads, ref_metrics = run_engine_loss(
            theirs, policy, loss_agg_mode, BATCH_INFO[batch_info], is_weights
        )
        assert torch.isfinite(loss)
        assert_close(loss, ref_loss, F32, "loss")
        for name, grad, ref in zip(("log_probs", "entropy"), grads, ref_grads, strict=True):
            assert_close(grad, ref, F32, f"grad {name}")
        assert set(ref_metrics) <= set(metrics), (sorted(ref_metrics), sorted(metrics))
        for name, value in ref_metrics.items():
            assert_close(torch.tensor(metrics[name]), torch.tensor(value), F32, name)


def test_engine_batch_exercises_the_trust_regions():
    """The batch above is not trivial for DPPO: verl's own dppo_tv masks and truncates some of its tokens."""
    _, _, metrics = run_engine_loss("dppo_tv", {}, "token-mean", BATCH_INFO["local"], False)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0

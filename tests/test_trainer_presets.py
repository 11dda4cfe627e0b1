"""The trainer applies a paper preset's rewards, sampler, advantage inputs and regularizers: the pipeline on
hand-made tensors, then every shipped preset on the tiny demo (trains 2 steps, or raises naming what it lacks)."""

import dataclasses
import math

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from grpo_kernels import presets
from grpo_kernels.regularizers import LambdaGRPOWeights, tr_grpo_weights
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.components import PresetComponents, StepSamples, correctness
from grpo_kernels.trainer.config import advantage_function, apply_preset
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.rollout import RolloutBatch
from grpo_kernels.trainer.samplers import DynamicSampling, GPGResampling, Round, XRPOAllocation
from grpo_kernels.trainer.tasks import AdditionTask, Prompt, RewardBatch
from grpo_kernels.trainer.train import GRPOTrainer
from tests.gather_ranks import gather_rank
from tests.rendezvous import rendezvous

ONE_PROCESS = ParallelState(0, 1, torch.device("cpu"), "none")
TRAINS = [
    "amir_grpo", "cispo", "dapo", "daro", "dr_grpo", "dra_grpo", "gapo", "gdpo", "gpg", "grpo", "grpo_lead", "grpo_s",
    "gspo", "gtpo", "info_grpo", "krpo", "lambda_grpo", "ms_grpo", "pvpo", "rank_grpo", "reinforce_pp", "rloo",
    "sapo", "spo", "tic_grpo", "tr_grpo", "unlikeliness", "xrpo",
]  # fmt: skip
RAISES = {  # preset -> what its ValueError names: the input no shipped task or model gives
    "p_grpo": r"reward 'p_grpo_posterior': cannot produce think_rewards \(a reasoning reward model's score",
    "stratified_grpo": r"advantage 'stratified': needs \['strata'\].*a trajectory's structure",
}


LOGGED = {  # a metric each sampler or learned weight adds
    "amir_grpo": "amir/lambda",
    "dapo": "sampling/groups_kept",
    "daro": "daro/w_1",
    "gpg": "sampling/gpg_alpha",
    "info_grpo": "info_grpo/term",
    "grpo_s": "sampling/groups_generated",
    "lambda_grpo": "lambda_grpo/lambda",
    "pvpo": "pvpo/ground_truth_injected",
    "xrpo": "sampling/xrpo_needs_seeding",
}


def components(preset: str | None, **overrides) -> PresetComponents:
    config = dataclasses.replace(apply_preset(TrainConfig(), preset), **overrides)
    return PresetComponents(config, AdditionTask(), ONE_PROCESS)


def make_round(rewards: list[float], group_size: int, length: int = 2, width: int = 1, prompts=None) -> Round:
    """A round of groups of `group_size` rows with these task rewards (and `answer` column), lengths 1, 2, ...
    cycling to `length`, sampling log-probs −1 − row / 10; `prompts` default to one per group."""
    rows = len(rewards)
    batch = RolloutBatch(
        prompt_ids=torch.full((rows, width), 5),
        prompt_mask=torch.ones(rows, width, dtype=torch.bool),
        completion_ids=torch.arange(rows * length).view(rows, length),
        completion_mask=torch.arange(length).expand(rows, length) <= torch.arange(rows)[:, None] % length,
        sampling_logp=-1 - torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, length) / 10,
        group_ids=torch.arange(rows) // group_size,
        completions=[str(i) for i in range(rows)],
        truncated=torch.zeros(rows, dtype=torch.bool),
    )
    scores = RewardBatch(torch.tensor(rewards), torch.tensor(rewards)[:, None], ("answer",))
    prompts = prompts or [Prompt(f"q{i}", "1") for i in range(rows // group_size)]
    return Round(prompts, batch, scores)


class FakeSource:
    """A sampler's source whose rounds have the given task rewards in turn; round k has prompts of width k and
    completions of length k + 1."""

    def __init__(self, rounds: list[list[float]], num_prompts: int = 2, num_generations: int = 2) -> None:
        self.rounds, self.num_prompts, self.num_generations, self.calls = list(rounds), num_prompts, num_generations, []

    def draw(self) -> list[Prompt]:
        return [Prompt(f"q{i}", "1") for i in range(self.num_prompts)]

    def generate(self, prompts: list[Prompt], num_generations: int) -> Round:
        self.calls.append((len(prompts), num_generations))
        k = len(self.calls)
        return make_round(self.rounds.pop(0), num_generations, length=k + 1, width=k, prompts=prompts)

    def rewards(self, round: Round) -> torch.Tensor:
        return round.scores.rewards


# ---------------------------------------------------------------------------------------------------- rewards
def test_default_preset_reward_is_the_task_reward_exactly():
    round = make_round([0.7, 0.1, 0.3, 0.3], 2)
    rewards, terms = components("grpo").rewards(round)
    assert torch.equal(rewards, round.scores.rewards) and terms.shape == (4, 1)
    assert torch.equal(components(None).rewards(round)[0], round.scores.rewards)


def preset_file(tmp_path, rewards: list[dict]) -> str:
    """A preset YAML with these rewards (GRPO otherwise), as `--preset path/to/file.yaml` takes it."""
    data = {"name": "test", "paper": {"title": "test", "arxiv": "2503.14476"}, "loss": {"loss_type": "grpo"}}
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump({**data, "advantage": {"name": "grpo"}, "rewards": rewards}), encoding="utf-8")
    return str(path)


def test_reward_pipeline_sums_weighted_terms_and_reshapes_in_order(tmp_path):
    round = make_round([1.0, 0.0, 1.0, 1.0], 2, length=4)  # lengths 1, 2, 3, 4
    overlong = {"name": "dapo_overlong", "max_completion_len": 4, "soft_punish_cache": 2}
    rewards, terms = components(preset_file(tmp_path, [{"name": "math_answer", "weight": 2.0}, overlong])).rewards(
        round
    )
    overlong = torch.tensor([0.0, 0.0, -0.5, -1.0])  # clamp((4 − 2 − |y|) / 2, −1, 0)
    torch.testing.assert_close(rewards, 2 * round.scores.rewards + overlong)
    torch.testing.assert_close(terms, torch.stack([round.scores.rewards, overlong], 1))
    # unlikeliness: the most likely completion of each group (sampling logp −1.0 and −1.2) loses 0.25 · 1 / 2
    rewards, _ = components("unlikeliness").rewards(round)
    torch.testing.assert_close(rewards, torch.tensor([0.875, 0.0, 0.875, 1.0]))
    # GRPO-LEAD: exp(−0.05 z) over the correct answers' lengths of the group, −1 when wrong
    rewards, _ = components("grpo_lead").rewards(round)
    z = (torch.tensor([3.0, 4.0]) - 3.5) / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0, *torch.exp(-0.05 * z).tolist()]))
    # GDPO's entries are columns: format (a text reward: never matched here) and the task's reward
    gdpo = components("gdpo")
    torch.testing.assert_close(gdpo.rewards(round)[1], torch.stack([torch.zeros(4), round.scores.rewards], 1))
    assert gdpo.advantage_kwargs == {"eps": 1e-4, "weights": [1.0, 1.0]}


# ----------------------------------------------------------------------------------------------- advantages
def step_samples(round: Round, pipeline) -> StepSamples:
    rewards, terms = pipeline(round)
    return StepSamples(
        batch=round.batch,
        group_ids=round.batch.group_ids,
        rewards=rewards,
        terms=terms,
        correct=correctness(round.scores),
        sequence_weights=None,
        metrics={},
    )


def test_estimators_get_the_inputs_their_signature_names():
    round = make_round([1.0, 0.0, 1.0, 1.0], 2, length=3)  # lengths 1, 2, 3, 1
    old_logp = -torch.rand(4, 3) * round.batch.completion_mask
    entropy = torch.rand(4, 3)
    expected = {
        "grpo": set(),
        "reinforce_pp": {"lengths"},
        "tic_grpo": set(),  # the paper's advantage is GRPO's; the length-corrected one is the port's
        "grpo_lead": {"correctness"},
        "xrpo": {"correctness", "mean_logp"},
        "gtpo": {"correctness", "entropy", "mask"},
    }
    for name, inputs in expected.items():
        c = components(name)
        got = c.advantage_inputs(step_samples(round, c.rewards), old_logp, entropy)
        assert set(got) == {"rewards", "group_ids"} | inputs, name
    xrpo = components("xrpo")
    got = xrpo.advantage_inputs(step_samples(round, xrpo.rewards), old_logp, entropy)
    torch.testing.assert_close(got["mean_logp"], old_logp.sum(1) / torch.tensor([1.0, 2.0, 3.0, 1.0]))
    assert got["correctness"].tolist() == [True, False, True, True]
    rpp = components("reinforce_pp")
    assert rpp.advantage_inputs(step_samples(round, rpp.rewards), old_logp, entropy)["lengths"].tolist() == [1, 2, 3, 1]
    gtpo = components("gtpo")
    got = gtpo.advantage_inputs(step_samples(round, gtpo.rewards), old_logp, entropy)
    assert torch.equal(got["mask"], round.batch.completion_mask) and torch.equal(got["entropy"], entropy)
    with pytest.raises(
        ValueError, match=r"advantage 'stratified' \(preset 'grpo'\) needs per-step inputs \['strata'\]"
    ):
        advantage_function(dataclasses.replace(TrainConfig(), advantage="stratified"))


def test_gather_inputs_pads_per_token_inputs_to_a_common_length():
    with mp.Manager() as manager, rendezvous() as store:
        results = manager.dict()
        mp.spawn(gather_rank, args=(store, results), nprocs=2, join=True)
        results = dict(results)
    assert results["rewards"].tolist() == [1.0, 2.0, 11.0, 12.0] and results["group_ids"].tolist() == [0, 0, 2, 2]
    assert (
        results["mask"].dtype == torch.bool and results["mask"].tolist() == [[True, True, False]] * 2 + [[True] * 3] * 2
    )
    assert results["entropy"].shape == (4, 3) and results["local0"].tolist() == [[1.0, 1.0]] * 2
    assert results["local1"].tolist() == [[2.0] * 3] * 2


# -------------------------------------------------------------------------------------------------- samplers
def test_dapo_drops_equal_groups_and_fills_the_batch_over_rounds():
    source = FakeSource([[0.0, 1.0, 0.5, 0.5], [1.0, 1.0, 0.0, 1.0], [0.3, 0.1, 0.0, 0.0]])  # verdict: answer > 0.5
    collected = DynamicSampling(target_groups=2)(source)
    batch = collected.round.batch
    assert collected.metrics == {
        "sampling/groups_generated": 4,
        "sampling/groups_kept": 2,
        "sampling/rounds": 2,
        "sampling/short_batch": 0.0,
    }
    assert batch.completions == ["0", "1", "2", "3"]  # round 1's first group, round 2's second
    assert batch.group_ids.tolist() == [0, 0, 3, 3] and collected.round.scores.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch.prompt_mask.tolist() == [[False, True]] * 2 + [[True, True]] * 2  # round 1 left-padded
    assert batch.completion_ids.shape == (4, 3) and not batch.completion_mask[:2, 2].any()  # right-padded
    short = DynamicSampling(target_groups=2, max_num_gen_batches=2)(FakeSource([[1.0] * 4] * 2))
    assert short.metrics["sampling/short_batch"] == 1.0 and short.metrics["sampling/groups_kept"] == 0  # not an error


def test_gpg_resamples_until_enough_valid_rows_and_weighs_them_by_alpha():
    source = FakeSource([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    collected = GPGResampling(min_inverse_alpha=0.5)(source)
    assert len(source.calls) == 2 and collected.metrics["sampling/gpg_alpha"] == 2.0  # B / B_valid = 4 / 2
    assert collected.round.scores.rewards.tolist() == [0.0, 1.0, 1.0, 1.0]  # valid rows, then the last round's
    assert collected.sequence_weights.tolist() == [2.0] * 4
    with pytest.raises(ValueError, match="3 rounds"):
        GPGResampling(max_rounds=3)(FakeSource([[1.0] * 4] * 3))


def test_xrpo_spends_half_the_rollouts_uniformly_and_allocates_the_rest():
    source = FakeSource([[0.0, 1.0, 1.0, 1.0], [0.5] * 4], num_prompts=2, num_generations=4)
    collected = XRPOAllocation()(source)
    assert source.calls == [(2, 2), (4, 1)]  # 2 rollouts per prompt, then the other 4 one at a time
    sizes = torch.bincount(collected.round.batch.group_ids).tolist()
    assert sum(sizes) == 8 and min(sizes) >= 2 and sizes[0] > sizes[1]  # the uncertain prompt gets more
    assert collected.metrics == {"sampling/xrpo_needs_seeding": 0.0, "sampling/rounds": 2}


# ---------------------------------------------------------------------------------------------- regularizers
def test_token_weights_and_lambda_learned_from_dl_dw(tmp_path):
    round = make_round([1.0, 0.0, 1.0, 1.0], 2, length=3)
    old_logp = -torch.rand(4, 3)
    tr = components("tr_grpo")
    weights = tr.weights(step_samples(round, tr.rewards), old_logp)
    assert torch.equal(weights.token, tr_grpo_weights(old_logp, alpha=2.0, tau=9.0, mu=0.25, low=1.0, high=1.4))
    assert weights.sequence is None
    lam = components("lambda_grpo")
    step = step_samples(round, lam.rewards)
    weights = lam.weights(step, old_logp)
    assert weights.sequence.is_leaf and weights.sequence.requires_grad
    shares = torch.tensor([0.3, -0.2, 0.5, 0.1])  # dL/dw_i: each sequence's share of the loss
    (weights.sequence * shares).sum().backward()  # what the update does
    lengths = round.batch.completion_mask.sum(1)
    reference = LambdaGRPOWeights(lam=0.0, r=0.1111)
    (grad,) = torch.autograd.grad((reference(lengths, step.group_ids) * shares).sum(), reference.lam)
    assert lam.learn(weights) == pytest.approx({"lambda_grpo/lambda": -0.1 * grad.item()})
    with pytest.raises(ValueError, match="num_iterations = 1"):
        components("lambda_grpo", num_iterations=2)


@pytest.mark.parametrize("name", ["lambda_grpo", "daro", "amir_grpo", "pvpo"])
def test_preset_state_resumes_exactly(name, tmp_path):
    """λ-GRPO's λ, DARO's w, AMIR's λ and PVPO's reference values are in the checkpoint: 2 + 2 steps = 4 steps."""

    def run(folder, steps: int, **overrides) -> list[dict]:
        base = TrainConfig(steps=steps, prompts_per_step=4, num_generations=4, eval_every=0, checkpoint_every=2)
        config = apply_preset(dataclasses.replace(base, progress=False, plot=False, output_dir=str(folder)), name)
        return GRPOTrainer(dataclasses.replace(config, **overrides), task=AdditionTask()).train()

    run(tmp_path / "a", 2)
    resumed = run(tmp_path / "a", 4, resume=True)
    straight = run(tmp_path / "b", 4)
    state = [m for m in straight[2:][0] if m.startswith(("lambda_grpo/", "daro/", "amir/", "pvpo/"))]
    assert state and "loss" in straight[-1]
    for key in ["loss", "reward", *state]:
        assert [m[key] for m in resumed[2:]] == [m[key] for m in straight[2:]], key
    if name in ("lambda_grpo", "daro"):  # learned: the weights moved
        assert any(straight[2][k] != 1.0 and straight[2][k] != 0.0 for k in state), state


# ---------------------------------------------------------------------------------------------- end to end
def test_every_shipped_preset_is_either_trained_or_refused():
    assert sorted([*TRAINS, *RAISES]) == presets.available()


@pytest.mark.parametrize("name", presets.available())
def test_preset_trains_two_steps_on_the_demo_or_raises(name, tmp_path):
    base = TrainConfig(steps=2, prompts_per_step=4, num_generations=4, eval_every=0, checkpoint_every=0)
    config = apply_preset(dataclasses.replace(base, progress=False, plot=False, output_dir=str(tmp_path)), name)
    if name in RAISES:
        with pytest.raises(ValueError, match=f"preset '{name}': the trainer cannot apply .*{RAISES[name]}"):
            GRPOTrainer(config)
        return
    history = GRPOTrainer(config).train()
    assert [r["step"] for r in history] == [1, 2] and all(math.isfinite(r["loss"]) for r in history)
    assert {"rewards/answer", "rewards/closeness", "rewards/format", LOGGED.get(name, "reward")} <= set(history[-1])

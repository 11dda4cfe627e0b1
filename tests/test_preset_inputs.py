"""The inputs the trainer produces for the presets whose papers need more than a verdict: GAPO's answer keys, SPO's
correct-prefix scores, RankGRPO's ranks, DRA-GRPO's policy embeddings, PVPO's cached reference values and
ground-truth injection, AMIR-GRPO's preference term through the policy's forward, DARO's learned weights."""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from grpo_kernels.options import LossOptions
from grpo_kernels.rewards import REWARDS
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.components import PresetComponents, StepSamples
from grpo_kernels.trainer.config import apply_preset
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.parallel import ParallelState, wrap_policy
from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch
from grpo_kernels.trainer.preset_amir import PreferencePolicy
from grpo_kernels.trainer.preset_info import InfoPolicy, InfoRounds, reverse_numbers, swap_operands
from grpo_kernels.trainer.preset_inputs import PolicyEmbedder, RewardInputs, correct_prefix_scores, group_ranks
from grpo_kernels.trainer.preset_pvpo import PVPOFilter, ReferenceValues
from grpo_kernels.trainer.rollout import HFRollout
from grpo_kernels.trainer.samplers import Round
from grpo_kernels.trainer.tasks import AdditionTask, CountdownTask, DatasetTask, Prompt, exact_answer, number_format
from grpo_kernels.trainer.update import inner_updates
from tests.rendezvous import join, rendezvous
from tests.test_trainer_presets import make_round

ONE_PROCESS = ParallelState(0, 1, torch.device("cpu"), "none")


def tiny_policy(seed: int = 0, init_std: float = 0.02):
    torch.manual_seed(seed)
    task = AdditionTask()
    tokenizer = build_tokenizer(task.alphabet)
    return build_tiny_llama(tokenizer, 16, 1, 2, 16, init_std), tokenizer


def addition_round(completions: list[str], answers: list[str], group_size: int) -> Round:
    """A round of the addition task with these completions (one prompt per group, its answer from `answers`)."""
    rows = len(completions)
    round = make_round([0.0] * rows, group_size)
    batch = dataclasses.replace(round.batch, completions=completions)
    prompts = [Prompt(f"q{g}", a) for g, a in enumerate(answers)]
    scores = AdditionTask().score(completions, [answers[g] for g in batch.group_ids.tolist()], batch.truncated)
    return Round(prompts, batch, scores)


# ------------------------------------------------------------------------------------------ rewards' inputs
def test_gapo_keys_are_the_answer_when_the_verifier_accepts_it():
    round = addition_round(["7", " 7", "3", "07"], ["7"], group_size=4)
    inputs = RewardInputs(AdditionTask())(round, ["answer_keys", "valid_answers"])
    assert inputs == {"answer_keys": ["7", "7", "3", "07"], "valid_answers": [("7",)] * 4}
    rewards = REWARDS.get("gapo_frequency")(**inputs, group_ids=round.batch.group_ids)
    assert rewards.tolist() == [1.0, 1.0, -1.0, -1.0]  # L = 1: f = 1 for the valid answer, 1 − (1 − 1) = 1
    reason = RewardInputs(CountdownTask()).reason("answer_keys")
    assert "may accept many answers per prompt" in reason and RewardInputs(AdditionTask()).reason("answer_keys") is None


def test_spo_rts_is_the_fraction_before_the_first_wrong_character():
    rts = correct_prefix_scores(["12", "13", "", " 1x3 ", "2", "123"], ["12"] * 6)
    torch.testing.assert_close(rts, torch.tensor([1.0, 0.5, 0.0, 1 / 3, 0.0, 2 / 3]))
    assert "step-wise judge" in RewardInputs(CountdownTask()).reason("rts")


def test_rank_grpo_ranks_share_ties_within_groups():
    scores = torch.tensor([0.9, 0.2, 0.9, 0.5, 1.0, 0.0])
    ranks = group_ranks(scores, torch.tensor([0, 0, 0, 0, 1, 1]))
    assert ranks.tolist() == [1, 4, 1, 3, 1, 2]


def test_rank_grpo_shapes_the_verdict_with_the_graded_rank():
    round = addition_round(["7", "8", "9", "x"], ["7"], group_size=4)  # closeness 1, 0.9, 0.8, 0: ranks 1..4
    config = apply_preset(TrainConfig(), "rank_grpo")
    rewards, _ = PresetComponents(config, AdditionTask(), ONE_PROCESS).rewards(round)
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0, 0.0, 0.0]))  # s · exp(τ(1 − k)), only "7" is right


def test_amir_pairs_are_mined_on_the_verdict_not_the_partial_credit():
    """AMIR's margin 1.5 separates its code's 2.0 / 0.0 correctness reward: a nearly right answer ("8" for 7) gets
    partial credit in the shaped reward (2 × (0.2 · 0.9 + 0.1) = 0.56, a gap of 1.44 < 1.5) but 0 on the verdict."""
    round = addition_round(["7", "8", "x", "7"], ["7"], group_size=4)
    components = PresetComponents(apply_preset(TrainConfig(), "amir_grpo"), AdditionTask(), ONE_PROCESS)
    shaped, terms = components.rewards(round)
    verdict = components.rewards.on_verdict(terms, round.scores.verdict)
    torch.testing.assert_close(verdict, torch.tensor([2.0, 0.0, 0.0, 2.0]))
    assert 2.0 - shaped[1].item() < 1.5  # the shaped gap would drop the ("7", "8") pair
    reshaping = PresetComponents(apply_preset(TrainConfig(), "rank_grpo"), AdditionTask(), ONE_PROCESS)
    with pytest.raises(ValueError, match="reshaping entries"):
        reshaping.rewards.on_verdict(terms, round.scores.verdict)


def test_dra_embedding_is_the_policy_hidden_mean_without_gradient():
    model, tokenizer = tiny_policy()
    embed = PolicyEmbedder()
    with pytest.raises(ValueError, match="no policy bound"):
        embed(["1"])
    embed.bind(model, tokenizer)
    e = embed(["12", "3", ""])
    assert e.shape == (3, 16) and not e.requires_grad and all(p.grad is None for p in model.parameters())
    encoded = tokenizer(["3"], return_tensors="pt")  # "<bos> 3": no padding
    hidden = model.get_decoder()(**encoded).last_hidden_state[0]  # [2, H]
    torch.testing.assert_close(e[1], hidden.mean(0).detach())
    config = apply_preset(TrainConfig(), "dra_grpo")
    components = PresetComponents(config, AdditionTask(), ONE_PROCESS)
    components.bind_policy(model, tokenizer)
    round = addition_round(["7", "7", "3", "8"], ["7"], group_size=4)
    rewards, _ = components.rewards(round)
    unit = F.normalize(embed(["7", "7", "3", "8"]), dim=-1)
    smi = ((unit @ unit.T).clamp(min=0) * (1 - torch.eye(4))).sum(1)
    torch.testing.assert_close(rewards, round.scores.rewards / (1 + smi))


# ------------------------------------------------------------------------------------------------------ PVPO
class CountingRollout(HFRollout):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[str] = []

    def generate(self, prompts, num_generations):
        self.prompts += list(prompts)
        return super().generate(prompts, num_generations)


def test_pvpo_values_are_cached_per_prompt_and_not_recomputed():
    model, tokenizer = tiny_policy()
    task = AdditionTask()
    reference = ReferenceValues(task, lambda r: r.scores.rewards, num_rollouts=3)
    reference.bind(model, tokenizer, 2, 1.0)
    reference.rollout = CountingRollout(model, tokenizer, 2, 1.0)
    prompts = [Prompt("1+2=", "3"), Prompt("4+4=", "8")]
    reference.ensure(prompts + prompts[:1])
    value, accuracy = reference.cache["1+2="]
    assert reference.rollout.prompts == ["1+2=", "4+4="] and 0.0 <= value <= 1.0 and accuracy in (0.0, 1 / 3, 2 / 3, 1)
    reference.ensure([prompts[1], Prompt("5+0=", "5")])  # only the new prompt is rolled out
    assert reference.rollout.prompts == ["1+2=", "4+4=", "5+0="] and reference.computed == 3
    restored = ReferenceValues(task, lambda r: r.scores.rewards, num_rollouts=3)
    restored.load_state_dict(reference.state_dict())
    round = addition_round(["1", "2", "3", "4"], ["3", "8"], group_size=2)
    round = round._replace(prompts=prompts)
    assert restored.values(round).tolist() == pytest.approx([value] * 2 + [reference.cache["4+4="][0]] * 2)


class FixedSource:
    num_generations, parallel = 2, None

    def __init__(self, rollout, task, draws):
        self.rollout, self.task, self.draws = rollout, task, list(draws)

    def draw(self):
        return self.draws.pop(0)

    def generate(self, prompts, num_generations):
        batch = self.rollout.generate([p.text for p in prompts], num_generations)
        answers = [prompts[i].answer for i in batch.group_ids.tolist()]
        return Round(prompts, batch, self.task.score(batch.completions, answers, batch.truncated))


def test_pvpo_filter_drops_solved_prompts_and_injects_the_ground_truth():
    model, tokenizer = tiny_policy()
    task = AdditionTask()
    reference = ReferenceValues(task, lambda r: r.scores.rewards, num_rollouts=2)
    reference.cache = {"1+1=": (1.0, 1.0), "2+2=": (0.0, 0.0), "3+3=": (0.35, 0.5), "4+0=": (0.2, 0.0)}
    pvpo = PVPOFilter(reference, task, temperature=1.0)
    pvpo.bind(model, tokenizer, 2)
    rollout = HFRollout(model, tokenizer, 2, 1.0)
    draws = [[Prompt("1+1=", "2"), Prompt("2+2=", "4")], [Prompt("3+3=", "6"), Prompt("4+0=", "4")]]
    collected = pvpo(FixedSource(rollout, task, draws))
    round = collected.round
    assert [p.text for p in round.prompts] == ["2+2=", "3+3="]  # "1+1=" is solved by the reference: dropped
    assert collected.metrics == {
        "pvpo/prompts_dropped": 1.0,
        "pvpo/ground_truth_injected": 1.0,
        "pvpo/ground_truth_too_long": 0.0,
    }
    assert round.batch.completions[1] == "4" and bool(round.scores.verdict[1])  # group 0's last rollout
    assert round.batch.completion_mask[1].sum() == 2  # "4" and <eos>
    logp = PolicyModule(model).logprobs(
        round.batch.input_ids[1:2], round.batch.attention_mask[1:2], round.batch.completion_mask[1:2], 1.0
    )[0]
    torch.testing.assert_close(round.batch.sampling_logp[1:2], logp)  # the policy's own log-probs


# ------------------------------------------------------------------------------------------------------ AMIR
def test_amir_preference_gradient_flows_through_the_policy_and_matches_float64():
    model, tokenizer = tiny_policy(1)
    rollout = HFRollout(model, tokenizer, 3, 1.0)
    torch.manual_seed(0)
    batch = rollout.generate(["1+2=", "4+4="], 3)
    rewards = torch.tensor([2.0, 0.0, 0.0, 0.0, 2.0, 0.3])  # pairs: (0, 1), (0, 2); (4, 3), (4, 5)
    options = LossOptions(loss_type="grpo", beta=0.0)
    update = UpdateBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        completion_mask=batch.completion_mask,
        advantages=torch.zeros(6),
        old_logp=batch.sampling_logp,
    )  # advantages 0: the GRPO term has no gradient
    policy = PreferencePolicy(model, beta=0.2, lam=0.01, margin=1.5)
    policy.set_step(rewards, batch.group_ids)
    loss, metrics = policy(update, options)
    loss.backward()
    assert metrics["amir/lambda"].item() == pytest.approx(0.008)  # L_GRPO = 0: ratio > 0.7, λ × 0.8
    reference = build_tiny_llama(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_length=16).double()
    reference.load_state_dict(model.state_dict())
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, P + T, V]
    T = batch.completion_mask.shape[1]
    logp = logits[:, -T - 1 : -1].log_softmax(-1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    ell = (logp * batch.completion_mask).sum(1)  # [B]
    pairs = [(0, 1), (0, 2), (4, 3), (4, 5)]
    expected = 0.008 * sum(-F.logsigmoid(0.2 * (ell[i] - ell[j])) for i, j in pairs) / len(pairs)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        scale = q.grad.abs().max().clamp(min=1e-6)
        assert (p.grad.double() - q.grad).abs().max() <= 1e-5 * scale, name
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="sees 2 rows, set_step gave rewards for 6"):
        policy(update.rows(torch.tensor([0, 1])), options)


# ------------------------------------------------------------------------------------------------------ DARO
def test_daro_weights_follow_the_bin_losses_read_from_dl_dv():
    config = dataclasses.replace(apply_preset(TrainConfig(), "daro"), num_generations=4)  # K = 3 bins
    components = PresetComponents(config, AdditionTask(), ONE_PROCESS)
    round = make_round([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], 4, length=3)  # pass rates 1/4, 2/4, 4/4
    rewards, terms = components.rewards(round)
    step = StepSamples(
        batch=round.batch,
        group_ids=round.batch.group_ids,
        rewards=rewards,
        terms=terms,
        correct=round.scores.verdict,
        sequence_weights=None,
        metrics={},
    )
    weights = components.weights(step, torch.zeros(12, 3))
    lengths = round.batch.completion_mask.sum(1).float()  # 1, 2, 3, 1, 2, ...
    tokens = torch.tensor([lengths[:4].sum(), lengths[4:8].sum(), 0.0])  # bins 0, 1 (μ = 1/4, 2/4); group 3 drops
    expected = torch.cat([1 / tokens[0].expand(4), 1 / tokens[1].expand(4), torch.zeros(4)])
    torch.testing.assert_close(weights.sequence.detach(), expected)  # w = 1 at the start
    sums = torch.arange(12.0) - 4  # each sequence's token-sum loss S_i
    (weights.sequence * sums).sum().backward()  # the token-sum update: L = Σ v_i S_i
    metrics = components.learn(weights)
    losses = torch.stack([sums[:4].sum() / tokens[0], sums[4:8].sum() / tokens[1]])  # L_μ of bins 0, 1
    u = torch.full((2,), math.log(math.expm1(1.0)), requires_grad=True)
    w = F.softplus(u)
    ((w * losses.abs()).sum() - torch.log(w).sum()).backward()  # ∂/∂w = |L_μ| − 1/w
    moved = F.softplus(u - 0.1 * u.grad)
    assert metrics["daro/w_1"] == pytest.approx(moved[0].item()) and metrics["daro/w_2"] == pytest.approx(
        moved[1].item()
    )
    assert metrics["daro/w_3"] == pytest.approx(1.0)  # absent this step: unchanged


DARO_CORRECT = [1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 1, 0]  # pass rates 1/4, 2/4 | 1/4, 3/4: bin 0 on both ranks


def _daro_step(rows: slice, parallel: ParallelState) -> torch.Tensor:
    """DARO's w after one token-sum update on `rows` of a 16-row step (4 groups of 4), on this rank."""
    config = dataclasses.replace(apply_preset(TrainConfig(), "daro"), num_generations=4)
    components = PresetComponents(config, AdditionTask(), parallel)
    round = make_round([float(c) for c in DARO_CORRECT], 4, length=3)
    batch = round.batch
    step = StepSamples(
        batch=batch,
        group_ids=batch.group_ids,
        rewards=round.scores.rewards,
        terms=round.scores.rewards[:, None],
        correct=round.scores.verdict,
        sequence_weights=None,
        metrics={},
    )
    step = StepSamples(
        **{k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in vars(step).items()}
        | {"batch": dataclasses.replace(batch, completion_mask=batch.completion_mask[rows])}
    )
    weights = components.weights(step, torch.zeros(4, 3))
    torch.manual_seed(0)
    model = build_tiny_llama(build_tokenizer("0123456789+="), 16, 1, 2, 8)
    ids = torch.randint(4, 16, (16, 8), generator=torch.Generator().manual_seed(1))[rows]
    mask = step.batch.completion_mask
    update = UpdateBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=mask,
        advantages=torch.randn(16, generator=torch.Generator().manual_seed(2))[rows],
        old_logp=torch.full((len(ids), 3), -2.5) * mask,
        sequence_weights=weights.sequence,
    )
    policy = wrap_policy(PolicyModule(model), parallel)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    inner_updates(policy, optimizer, update, options=config.loss, num_iterations=1, max_grad_norm=1e9)
    components.learn(weights)
    return components.learner.module.weights.detach().clone()


def _daro_rank(rank: int, store: str, results) -> None:
    torch.set_num_threads(1)
    join(rank, 2, store)
    w = _daro_step(slice(8 * rank, 8 * rank + 8), ParallelState(rank, 2, torch.device("cpu"), "ddp"))
    if rank == 0:
        results["w"] = w
    dist.destroy_process_group()


def test_daro_weights_under_ddp_equal_one_process():
    with mp.Manager() as manager, rendezvous() as store:
        results = manager.dict()
        mp.spawn(_daro_rank, args=(store, results), nprocs=2, join=True)
        got = results["w"]
    want = _daro_step(slice(0, 16), ONE_PROCESS)
    assert (want != 1.0).all()  # every bin moved: μ = 1/4 on both ranks, 2/4 on rank 0, 3/4 on rank 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "name, overrides, parallel, match",
    [
        ("gapo", {}, ONE_PROCESS, r"answer_keys \(GAPO's answer keys .*task 'countdown' may accept many answers"),
        ("spo", {}, ONE_PROCESS, r"rts \(SPO's correct-prefix score .*a step-wise judge model would be needed"),
        ("pvpo", {}, ONE_PROCESS, r"PVPO's reference pre-rollouts: .*task 'countdown''s answer field is what"),
        ("pvpo", {"beta": 0.0}, ONE_PROCESS, "exists only with beta != 0"),
        ("dra_grpo", {}, ParallelState(0, 1, torch.device("cpu"), "fsdp"), r"embed \(the policy's hidden states"),
        ("amir_grpo", {"num_iterations": 2}, ONE_PROCESS, r"regularizer 'amir': needs num_iterations = 1"),
        ("info_grpo", {"dataset": "qa"}, ONE_PROCESS, r"augmentation z of task 'qa''s prompts \(none is defined\)"),
    ],
)
def test_inputs_without_an_honest_source_are_refused_with_the_reason(name, overrides, parallel, match):
    config = apply_preset(TrainConfig(), name)
    loss = {k: v for k, v in overrides.items() if k == "beta"}
    config = dataclasses.replace(config, loss=dataclasses.replace(config.loss, **loss))
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if k not in ("beta", "dataset")})
    task = CountdownTask(eval_size=1)
    if overrides.get("dataset") == "qa":  # a dataset task (GSM8K, JSONL): plain questions, no augmentation
        task = DatasetTask("qa", [Prompt("Q: 1?", "1")], [Prompt("Q: 2?", "2")], exact_answer, number_format)
    with pytest.raises(ValueError, match=f"preset '{name}': the trainer cannot apply .*{match}"):
        PresetComponents(config, task, parallel)


# ------------------------------------------------------------------------------------------------- Info-GRPO
def test_info_grpo_augmentations_keep_the_answer():
    assert swap_operands(Prompt("3+4=", "7")) == Prompt("4+3=", "7")
    prompt = CountdownTask(eval_size=1).sample(1, torch.Generator().manual_seed(0))[0]
    augmented = reverse_numbers(prompt)
    assert augmented.answer == prompt.answer and augmented.text.split()[1:-2] == prompt.text.split()[1:-2][::-1]
    with pytest.raises(ValueError, match="not an addition prompt"):
        swap_operands(Prompt("Using 1 2 reach 3:", "{}"))


def test_info_grpo_groups_hold_original_and_augmented_rollouts():
    model, tokenizer = tiny_policy()
    rollout = HFRollout(model, tokenizer, 2, 1.0)
    sampler = InfoRounds(swap_operands)
    source = FixedSource(rollout, AdditionTask(), [[Prompt("1+2=", "3"), Prompt("5+0=", "5")]])
    source.num_generations = 3
    round = sampler(source).round
    assert (
        round.batch.group_ids.tolist() == [0, 0, 1, 1, 0, 1] and sampler.augmented.tolist() == [False] * 4 + [True] * 2
    )
    texts = tokenizer.batch_decode(round.batch.prompt_ids, skip_special_tokens=True)
    assert texts == ["1+2=", "1+2=", "5+0=", "5+0=", "2+1=", "0+5="] and round.answers == ["3", "3", "5", "5", "3", "5"]


def test_info_grpo_term_has_the_entropy_gradient_of_the_policy_in_float64():
    model, tokenizer = tiny_policy(2, init_std=0.5)  # a peaked softmax: entropy gradients well above fp32 noise
    torch.manual_seed(0)
    batch = HFRollout(model, tokenizer, 3, 1.0).generate(["1+2=", "2+1="], 2)
    augmented = torch.tensor([False, False, True, True])
    update = UpdateBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        completion_mask=batch.completion_mask,
        advantages=torch.zeros(4),
        old_logp=batch.sampling_logp,
    )  # advantages 0: only the information term has a gradient
    policy = InfoPolicy(model, alpha=0.5, lam=0.1)  # α = 0.5: no cancellation between the two entropies
    policy.set_step(augmented)
    loss, _ = policy(update, LossOptions(loss_type="grpo", beta=0.0))
    loss.backward()
    reference = build_tiny_llama(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_length=16).double()
    reference.load_state_dict(model.state_dict())
    T = batch.completion_mask.shape[1]
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, -T - 1 : -1]
    p = logits.softmax(-1)
    entropy = -(p * logits.log_softmax(-1)).sum(-1)  # [B, T]
    mask = batch.completion_mask.double()
    h = (entropy * mask).sum(1) / mask.sum(1)  # [B] per-sequence mean token entropy
    expected = -0.1 * (0.5 * h[~augmented].mean() - h[augmented].mean())
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (a.grad.double() - b.grad).abs().max() <= 1e-5 * b.grad.abs().max().clamp(min=1e-6), name

"""The samplers decide on the task's 0/1 verdicts, and under data parallelism they decide globally: DAPO resamples an
all-wrong group whose shaped rewards differ; 2 gloo processes keep the same groups and make the same update as 1."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_kernels.advantages import ADVANTAGES
from grpo_kernels.options import LossOptions
from grpo_kernels.trainer.components import gather_inputs, local_part
from grpo_kernels.trainer.model import build_tiny_llama, build_tokenizer
from grpo_kernels.trainer.parallel import ParallelState, local_rows, wrap_policy
from grpo_kernels.trainer.policy import PolicyModule, UpdateBatch
from grpo_kernels.trainer.rollout import RolloutBatch
from grpo_kernels.trainer.samplers import DynamicSampling, GPGResampling, Round
from grpo_kernels.trainer.tasks import Prompt, RewardBatch
from grpo_kernels.trainer.update import inner_updates
from tests.rendezvous import join, rendezvous

PROMPTS, G, VOCAB = 4, 2, 16
# round -> per prompt the verdicts of its G completions; shaped rewards differ within every group (by length), so a
# filter on them would keep every group. Round 0 has one valid group per rank half, round 1 the others.
VERDICTS = [
    [(False, False), (True, False), (True, True), (False, True)],
    [(True, False), (False, False), (False, True), (True, True)],
    [(False, True), (True, False), (True, False), (False, True)],
]


class ScriptedSource:
    """A sampler's source whose rollouts depend only on (round, global prompt index, sample): every process
    generates the rows one process would for its share of the prompts."""

    num_generations = G

    def __init__(self, parallel: ParallelState | None) -> None:
        self.parallel, self.round = parallel, 0
        self.state = parallel or ParallelState(0, 1, torch.device("cpu"), "none")

    def draw(self) -> list[Prompt]:
        prompts = [Prompt(f"{self.round}:{i}", str(i)) for i in range(PROMPTS)]
        return prompts[local_rows(PROMPTS, self.state)]

    def generate(self, prompts: list[Prompt], num_generations: int) -> Round:
        verdicts, ids, lengths = [], [], []
        for prompt in prompts:
            r, i = map(int, prompt.text.split(":"))
            for g in range(num_generations):
                verdicts.append(VERDICTS[r][i][g])
                gen = torch.Generator().manual_seed(100 * r + 10 * i + g)
                ids.append(torch.randint(4, VOCAB, (4,), generator=gen))
                lengths.append(1 + (i + g + r) % 4)
        rows, width = len(verdicts), max(lengths)
        completion_mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]  # [B, T]
        prompt_ids = torch.tensor([[3, 4 + int(p.text[0]), 5 + int(p.text[-1])] for p in prompts])  # [P, 3]
        batch = RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(num_generations, 0),
            prompt_mask=torch.ones(rows, 3, dtype=torch.bool),
            completion_ids=torch.stack(ids)[:, :width] * completion_mask,
            completion_mask=completion_mask,
            sampling_logp=torch.full((rows, width), -2.0) * completion_mask,
            group_ids=torch.arange(len(prompts)).repeat_interleave(num_generations),
            completions=[str(n) for n in lengths],
            truncated=torch.zeros(rows, dtype=torch.bool),
        )
        correct = torch.tensor(verdicts)
        shaped = correct.float() * 0.7 + 0.05 * torch.tensor(lengths, dtype=torch.float32)  # [B] never all equal
        scores = RewardBatch(shaped, correct.float()[:, None], ("answer",), None, correct)
        self.round += 1
        return Round(prompts, batch, scores)

    def rewards(self, round: Round) -> torch.Tensor:
        return round.scores.rewards


def test_dapo_resamples_an_all_wrong_group_whose_shaped_rewards_differ():
    source = ScriptedSource(None)
    collected = DynamicSampling(target_groups=PROMPTS)(source)
    kept = collected.round
    assert collected.metrics == {
        "sampling/groups_generated": 8,
        "sampling/groups_kept": 4,
        "sampling/rounds": 2,
        "sampling/short_batch": 0.0,
    }
    # round 0 keeps prompts 1 and 3 (0 < #correct < G): prompt 0 is all wrong with lengths 1, 2, prompt 2 all right
    assert [kept.prompts[i].text for i in kept.batch.group_ids.unique().tolist()] == ["0:1", "0:3", "1:0", "1:2"]
    assert kept.scores.correct.view(-1, G).sum(1).tolist() == [1, 1, 1, 1]
    first = ScriptedSource(None).generate(ScriptedSource(None).draw(), G)  # round 0 again
    assert not first.scores.correct[:G].any() and first.scores.rewards[:G].unique().numel() == G  # dropped anyway


def test_gpg_counts_valid_groups_by_verdict():
    collected = GPGResampling(min_inverse_alpha=0.75)(ScriptedSource(None))
    # round 0: 2 valid groups (4 of 8 rows) < 0.75; with round 1: 4 valid groups, 8 rows -> alpha = 8 / 8
    assert collected.metrics["sampling/rounds"] == 2 and collected.metrics["sampling/gpg_alpha"] == 1.0
    assert collected.round.scores.correct.view(-1, G).sum(1).tolist() == [1, 1, 1, 1]


# ----------------------------------------------------------------------------------------- 2 processes vs 1
SAMPLERS = {  # GPG with one round: the 2 valid groups, then the 2 others, alpha = 2
    "dapo": lambda: DynamicSampling(target_groups=PROMPTS),
    "gpg": lambda: GPGResampling(min_inverse_alpha=0.5),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_tiny_llama(build_tokenizer("0123456789+="), 16, 2, 2, 16)


def _step(name: str, state: ParallelState) -> tuple[dict, list[torch.Tensor]]:
    """The sampler on this process's share, group advantages over all ranks, one SGD step (lr 1) of the fused
    DAPO loss: (the sampler's metrics, the parameters after the step)."""
    collected = SAMPLERS[name]()(ScriptedSource(state if state.world_size > 1 else None))
    round = collected.round
    group_ids = torch.unique(round.batch.group_ids, return_inverse=True)[1]  # [B]
    inputs = gather_inputs({"rewards": round.scores.rewards, "group_ids": group_ids}, state)
    advantages = local_part(ADVANTAGES.get("grpo")(**inputs), len(group_ids), 0, state)  # [B]
    batch = round.batch
    update = UpdateBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        completion_mask=batch.completion_mask,
        advantages=advantages,
        old_logp=batch.sampling_logp,
        sequence_weights=collected.sequence_weights,
    )
    policy = wrap_policy(PolicyModule(_model()), state)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    options = LossOptions(loss_type="dapo", epsilon_high=0.28)
    inner_updates(policy, optimizer, update, options=options, num_iterations=1, max_grad_norm=1e9)
    return collected.metrics, [p.detach().clone() for p in policy.parameters()]


def _rank(rank: int, store: str, results) -> None:
    torch.set_num_threads(1)
    join(rank, 2, store)
    state = ParallelState(rank, 2, torch.device("cpu"), "ddp")
    for name in SAMPLERS:
        metrics, params = _step(name, state)
        results[f"{name}{rank}"] = (metrics, params)
    dist.destroy_process_group()


def test_two_processes_keep_the_same_groups_and_make_the_same_update_as_one():
    with mp.Manager() as manager, rendezvous() as store:
        results = manager.dict()
        mp.start_processes(_rank, args=(store, results), nprocs=2, join=True, start_method="fork")  # no re-import
        results = dict(results)
    single = ParallelState(0, 1, torch.device("cpu"), "none")
    initial = [p.detach() for p in _model().parameters()]
    for name in SAMPLERS:
        metrics, want = _step(name, single)
        assert results[f"{name}0"][0] == results[f"{name}1"][0] == metrics, name  # one decision, as one process's
        assert max((w - p).abs().max().item() for w, p in zip(want, initial, strict=True)) > 1e-4, name
        for rank in (0, 1):
            for got, w in zip(results[f"{name}{rank}"][1], want, strict=True):
                torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_sampler_that_cannot_split_evenly_says_so():
    from grpo_kernels.trainer.samplers import local_share

    round = ScriptedSource(None).generate([Prompt("0:0", "0"), Prompt("0:1", "1"), Prompt("0:2", "2")], G)
    with pytest.raises(ValueError, match="3 groups of 6 rows do not split evenly over 2 ranks"):
        local_share(round, ParallelState(0, 2, torch.device("cpu"), "ddp"))

"""A preset's sampler in the training loop: which rollouts of a step reach the update, and how many rounds it takes.

A round is one `Rollout.generate` call on fresh prompts (or, for XRPO, on chosen ones) with the task's scores. The
samplers of `grpo_kernels.sampling` decide on each round's task verdicts (DAPO keeps a group when 0 < #correct < G,
GPG counts such groups as valid; a shaped reward would keep an all-wrong group whose lengths differ) or, for XRPO,
its step rewards; the rows they keep are merged into one batch (prompts re-padded on the left, completions on the
right), and dropped rows are simply not in it, so the loss normalisers count the kept rows, as the papers do. Every
sampler returns the step's batch, optional sequence weights (GPG's α) and its metrics (`sampling/...`: groups
generated and kept, rounds).

Under data parallelism (`GLOBAL_SAMPLERS`) every rank generates its share of the prompts, then the rounds of all
ranks are gathered (`gather_round`: rank order, the order of one process's batch), every rank takes the same
decision on the same global round, and keeps its contiguous share of the kept groups (`local_share`): the ranks
agree, and K processes train on the rows one process would. XRPO's groups end up of different sizes, which do not
split evenly over ranks, so it stays a single-process sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from grpo_kernels.groups import group_first, group_index
from grpo_kernels.sampling import DAPOBatchFiller, gpg_valid, xrpo_allocate
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.rollout import RolloutBatch
from grpo_kernels.trainer.tasks import Prompt, RewardBatch

# DAPO: rounds before giving up on filling a batch. verl's recipe/dapo allows 10 generation batches of 3× the training
# batch (gen_prompt_bsz = 3 · train_prompt_bsz); a round here draws one training batch of prompts, so 30 rounds
MAX_NUM_GEN_BATCHES = 30
GPG_MAX_ROUNDS = 20  # GPG: resampling rounds before giving up (AMAP-ML/GPG's `max_gen`)
RAISE_LIMIT = "--max-num-gen-batches N raises the limit (0: none; it may change on --resume)"
GLOBAL_SAMPLERS = ("dapo_dynamic", "gpg_valid")  # decide on the rounds of every rank (data parallelism)


class Round(NamedTuple):
    """Rollouts with the task's scores; `batch.group_ids` [B] index `prompts`."""

    prompts: list[Prompt]
    batch: RolloutBatch
    scores: RewardBatch

    @property
    def answers(self) -> list[str]:
        return [self.prompts[i].answer for i in self.batch.group_ids.tolist()]

    @property
    def num_groups(self) -> int:
        return len(self.batch.group_ids.unique())


class Collected(NamedTuple):
    """What a sampler hands on: the step's rollouts, optional sequence weights [B] and its metrics."""

    round: Round
    sequence_weights: Tensor | None
    metrics: dict[str, float]


class Source(Protocol):
    """Rounds for a sampler: fresh prompts (this rank's share), their rollouts and scores, and the step rewards of a
    round. `parallel` (absent or None: one process) lets a global sampler gather the ranks' rounds."""

    num_generations: int
    parallel: ParallelState | None

    def draw(self) -> list[Prompt]: ...

    def generate(self, prompts: list[Prompt], num_generations: int) -> Round: ...

    def rewards(self, round: Round) -> Tensor: ...


Sampler = Callable[[Source], Collected]


def single_round(source: Source) -> Collected:
    """No sampler: G rollouts of each prompt, all of them trained on."""
    return Collected(source.generate(source.draw(), source.num_generations), None, {})


class DynamicSampling:
    """DAPO dynamic sampling (`dapo_dynamic`, arXiv:2503.14476 §3.2): keep the groups with 0 < #correct < G (the
    task's verdicts, DAPO's `acc`: an all-wrong group is dropped whatever its shaped rewards) and generate more
    rounds until `target_groups` prompts are kept over all ranks (`DAPOBatchFiller`, verl's semantics: the filling
    round keeps the groups it needs).

    After `max_num_gen_batches` rounds without a full batch, verl stops the run; here the step trains on the groups
    it kept, and on the last round whole where it kept none (every group all right or all wrong: zero advantages, so
    only the regularizers move the policy, as plain GRPO would do). A run whose task is solved, where few groups
    differ, thus still finishes. The first such step prints one line; every step logs `sampling/short_batch`."""

    def __init__(self, target_groups: int, max_num_gen_batches: int = MAX_NUM_GEN_BATCHES) -> None:
        self.filler = DAPOBatchFiller(target_groups, max_num_gen_batches, short_batches=True)
        self.short_batches = 0

    def __call__(self, source: Source) -> Collected:
        parallel = getattr(source, "parallel", None)
        kept, generated = [], 0
        while True:
            round = gather_round(source.generate(source.draw(), source.num_generations), parallel)
            generated += round.num_groups
            verdict = self.filler.add(round.scores.verdict, round.batch.group_ids.cpu())
            kept.append(select(round, verdict.keep))
            if not verdict.generate_more:
                break
        short = verdict.num_kept < self.filler.target_groups
        batch = concat(kept) if verdict.num_kept else round
        if short:
            batch = _even_groups(batch, round, parallel)
            self._say_short(verdict.num_kept, parallel)
        metrics = {"sampling/groups_generated": generated, "sampling/groups_kept": verdict.num_kept}
        metrics |= {"sampling/rounds": len(kept), "sampling/short_batch": float(short)}
        return Collected(local_share(batch, parallel), None, metrics)

    def _say_short(self, num_kept: int, parallel: ParallelState | None) -> None:
        self.short_batches += 1
        if self.short_batches == 1 and (parallel is None or parallel.is_main):
            filler = self.filler
            trains_on = f"the {num_kept} it kept" if num_kept else "the last round's, whose advantages are all zero"
            print(
                f"dynamic sampling: {filler.max_num_gen_batches} generation rounds kept {num_kept} of "
                f"{filler.target_groups} prompts (most groups are all right or all wrong: the task may be solved, or "
                f"too hard); this step and any like it train on {trains_on} (logged as sampling/short_batch). "
                f"--max-num-gen-batches N sets the limit (0: none; it may change on --resume)",
                flush=True,
            )


class GPGResampling:
    """GPG's resampling (`gpg_valid`, arXiv:2504.02546): rounds until the valid groups (0 < #correct < G, the task's
    verdicts) hold at least `min_inverse_alpha` of a round's B rows over all ranks; the batch is those valid rows
    (chronological) then the last round's other rows, cut to B, and every sequence weighs α = B / B_valid
    (AMAP-ML/GPG's loop, ≤ 20 rounds; `max_rounds=0`: no limit)."""

    def __init__(self, min_inverse_alpha: float = 0.5, max_rounds: int = GPG_MAX_ROUNDS) -> None:
        self.min_inverse_alpha, self.max_rounds = min_inverse_alpha, max_rounds

    def __call__(self, source: Source) -> Collected:
        parallel = getattr(source, "parallel", None)
        rounds, verdicts = [], []
        while True:
            rounds.append(gather_round(source.generate(source.draw(), source.num_generations), parallel))
            verdicts.append(rounds[-1].scores.verdict)
            merged = concat(rounds)
            size = len(verdicts[0])
            verdict = gpg_valid(torch.cat(verdicts), merged.batch.group_ids.cpu(), size, self.min_inverse_alpha)
            if not verdict.generate_more:
                break
            if len(rounds) == self.max_rounds:
                raise ValueError(
                    f"gpg_valid: {self.max_rounds} rounds found {verdict.num_valid} rows in groups with unequal "
                    f"rewards, fewer than min_inverse_alpha={self.min_inverse_alpha} of {size}; the data may be too "
                    f"hard or too easy; {RAISE_LIMIT}"
                )
        last = torch.arange(len(verdict.valid)) >= len(verdict.valid) - size  # [R·B] the last round's rows
        order = torch.cat([verdict.valid.nonzero(), (last & ~verdict.valid).nonzero()]).squeeze(1)[:size]  # [B]
        kept = select(merged, order)
        metrics = {"sampling/groups_generated": merged.num_groups, "sampling/groups_kept": kept.num_groups}
        kept = local_share(kept, parallel)
        weights = torch.full((len(kept.batch.group_ids),), verdict.alpha)  # [B]
        return Collected(
            kept, weights, {**metrics, "sampling/rounds": len(rounds), "sampling/gpg_alpha": verdict.alpha}
        )


class XRPOAllocation:
    """XRPO's rollout allocation (`xrpo_allocate`, arXiv:2510.06672): the step's P·G rollouts are spent as half of
    them uniformly (at least 2 per prompt), then the rest one at a time to the prompts whose Student-t half-width
    shrinks most, plus an exploration bonus; groups end up of different sizes. The trainer's reading of the
    paper's rounds: one allocation round. In-context seeding of zero-reward prompts is not done, only counted."""

    def __init__(self, alpha: float = 0.05, exploration: float = 1.0) -> None:
        self.alpha, self.exploration = alpha, exploration

    def __call__(self, source: Source) -> Collected:
        prompts = source.draw()
        first = min(source.num_generations, max(2, source.num_generations // 2))
        round = source.generate(prompts, first)
        budget = len(prompts) * (source.num_generations - first)
        plan = xrpo_allocate(source.rewards(round), round.batch.group_ids.cpu(), budget, self.alpha, self.exploration)
        metrics = {"sampling/xrpo_needs_seeding": plan.needs_seeding.float().mean().item()}
        if budget == 0:
            return Collected(round, None, {**metrics, "sampling/rounds": 1})
        owners = plan.prompt_ids.repeat_interleave(plan.extra)  # [budget] the prompt of each extra rollout
        extra = source.generate([prompts[i] for i in owners.tolist()], 1)
        regrouped = RolloutBatch(**{**vars(extra.batch), "group_ids": owners.to(extra.batch.group_ids.device)})
        merged = concat([round, Round(prompts, regrouped, extra.scores)], shared_prompts=True)
        return Collected(merged, None, {**metrics, "sampling/rounds": 2})


# ------------------------------------------------------------------------------------------------ rows of rounds
def gather_round(round: Round, parallel: ParallelState | None) -> Round:
    """Every rank's round (exchanged through CPU), concatenated in rank order on this rank's device, each rank's group
    ids offset past the prompts of the ranks before it (`concat`): the same global round on every rank, in the order
    one process would have it. One process: `round` itself."""
    if parallel is None or parallel.world_size == 1:
        return round
    batch = RolloutBatch(**{k: v.cpu() if isinstance(v, Tensor) else v for k, v in vars(round.batch).items()})
    parts: list[Round | None] = [None] * parallel.world_size
    dist.all_gather_object(parts, Round(round.prompts, batch, round.scores))
    merged = concat(parts)
    device = round.batch.group_ids.device
    fields = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(merged.batch).items()}
    return Round(merged.prompts, RolloutBatch(**fields), merged.scores)


def _even_groups(short: Round, last: Round, parallel: ParallelState | None) -> Round:
    """A short batch's first groups, as many as split evenly over the ranks; the last (global) round whole where
    there are fewer groups than ranks."""
    if parallel is None or parallel.world_size == 1:
        return short
    groups = short.batch.group_ids.cpu()  # [B]
    firsts = group_first(group_index(groups, len(groups))).sort().values  # [P] each group's first row, batch order
    count = len(firsts) // parallel.world_size * parallel.world_size
    if count == 0:
        return last
    return select(short, torch.isin(groups, groups[firsts[:count]]))


def local_share(round: Round, parallel: ParallelState | None) -> Round:
    """This rank's contiguous share of a global round's rows: 1/K of its groups, whole (the groups are of equal size
    and their number splits evenly over the K ranks, as a global sampler's batch does). One process: `round`."""
    if parallel is None or parallel.world_size == 1:
        return round
    rows, k = len(round.batch.group_ids), parallel.world_size
    if rows % k or round.num_groups % k or rows % round.num_groups:
        raise ValueError(f"{round.num_groups} groups of {rows} rows do not split evenly over {k} ranks")
    share = rows // k
    return select(round, torch.arange(parallel.rank * share, (parallel.rank + 1) * share))


def select(round: Round, rows: Tensor) -> Round:
    """The round's rows `rows` ([B] bool, or indices), in that order."""
    rows = rows.nonzero().squeeze(1) if rows.dtype == torch.bool else rows  # [b]
    batch = round.batch
    fields = {
        name: value[rows.to(value.device)] if isinstance(value, Tensor) else [value[i] for i in rows.tolist()]
        for name, value in vars(batch).items()
    }
    scores = round.scores.select(rows)
    return Round(round.prompts, RolloutBatch(**fields), scores)


def concat(rounds: list[Round], shared_prompts: bool = False) -> Round:
    """The rounds' rows in order, prompts left-padded and completions right-padded to the widest; each round's group
    ids are offset past the previous rounds' prompts unless the rounds index the same `prompts` (`shared_prompts`)."""
    if len(rounds) == 1:
        return rounds[0]
    batches = [r.batch for r in rounds]
    width = max(b.prompt_ids.shape[1] for b in batches)
    length = max(b.completion_ids.shape[1] for b in batches)
    offsets = (
        [0] * len(rounds) if shared_prompts else [sum(len(r.prompts) for r in rounds[:i]) for i in range(len(rounds))]
    )
    batch = RolloutBatch(
        prompt_ids=torch.cat([_pad(b.prompt_ids, width, left=True) for b in batches]),  # [B, P]
        prompt_mask=torch.cat([_pad(b.prompt_mask, width, left=True) for b in batches]),  # [B, P]
        completion_ids=torch.cat([_pad(b.completion_ids, length) for b in batches]),  # [B, T]
        completion_mask=torch.cat([_pad(b.completion_mask, length) for b in batches]),  # [B, T]
        sampling_logp=torch.cat([_pad(b.sampling_logp, length) for b in batches]),  # [B, T]
        group_ids=torch.cat([b.group_ids + offset for b, offset in zip(batches, offsets, strict=True)]),  # [B]
        completions=[text for b in batches for text in b.completions],
        truncated=torch.cat([b.truncated for b in batches]),  # [B]
    )
    scores = RewardBatch.cat([r.scores for r in rounds])
    prompts = rounds[0].prompts if shared_prompts else [p for r in rounds for p in r.prompts]
    return Round(prompts, batch, scores)


def _pad(x: Tensor, width: int, left: bool = False) -> Tensor:
    """`x` [B, w] padded with zeros (False) to [B, width]; the masks say which entries are real."""
    extra = width - x.shape[1]
    return F.pad(x, (extra, 0) if left else (0, extra))  # [B, width]

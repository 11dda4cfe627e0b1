"""A preset's `rewards` list as the step reward, with the per-step inputs each entry's signature names.

`math_answer`, `gsm8k` and `countdown` stand for the task's verifier and are its full reward; the other entries are
called with the `REWARD_INPUTS` they name and with the inputs `preset_inputs.RewardInputs` produces from the task or
the policy (GAPO's answer keys, SPO's RTS, RankGRPO's ranks, DRA-GRPO's embedder); an input it cannot produce on the
task is a problem naming why. A reward that reshapes a 0/1 rule reward (`FLAG_RESHAPERS`: RankGRPO, Unlikeliness)
reads the verifier's verdict in place of the task's graded sum.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grpo_kernels import presets
from grpo_kernels.presets import ComponentConfig
from grpo_kernels.rewards import REWARDS
from grpo_kernels.trainer.preset_inputs import RewardInputs, verdict
from grpo_kernels.trainer.samplers import Round

VERIFIERS = ("math_answer", "gsm8k", "countdown")  # stand for the task's verifier: the task's full reward
REWARD_INPUTS = ("completions", "answers", "truncated", "lengths", "correct", "group_ids", "old_logp", "mask")
FLAG_RESHAPERS = ("rank_grpo", "unlikeliness")  # reshape a rule reward s ∈ {0, 1}: the verdict, not the task's sum


class RewardPipeline:
    """A preset's `rewards` list as the step reward: r = Σ_k w_k·term_k in order; an entry that reads `rewards`
    replaces the sum so far by w·f(sum). Returns (rewards [B], the unweighted terms [B, K])."""

    def __init__(self, entries: tuple[ComponentConfig, ...], problems: list[str], produced: RewardInputs) -> None:
        self.entries: list[tuple[float, Callable[..., Tensor] | None, dict[str, Any], bool]] = []
        self.produced, self.flags = produced, set()  # entries that reshape the verdict
        for k, entry in enumerate(entries):
            fn, kwargs = (None, {}) if entry.name in VERIFIERS else _reward_callable(entry, problems, produced)
            reshapes = entry.name not in VERIFIERS and presets.reshapes_rewards(REWARDS.get(entry.name))
            if entry.name in FLAG_RESHAPERS:
                self.flags.add(k)
                if [e.name in VERIFIERS and e.weight == 1.0 for e in entries[:k]] != [True]:
                    problems.append(
                        f"reward {entry.name!r}: reshapes a 0/1 rule reward, so one verifier of weight 1 "
                        "must come right before it and nothing else"
                    )
            self.entries.append((float(entry.weight), fn, kwargs, reshapes))
        self.weights = [weight for weight, *_ in self.entries]
        self.reshapes = any(reshapes for *_, reshapes in self.entries)
        self.identity = len(entries) == 1 and entries[0].name in VERIFIERS and entries[0].weight == 1.0
        self.uses_correctness = bool(self.flags) or any(
            fn is not None and {"correct", "outcome_rewards", "answer_keys"} & set(parameters(fn))
            for _, fn, _, _ in self.entries
        )
        self.needs = sorted(
            {n for _, fn, _, _ in self.entries if fn is not None for n in parameters(fn) if n in produced.producers}
        )

    def __call__(self, round: Round) -> tuple[Tensor, Tensor]:
        inputs = {**_reward_inputs(round), **self.produced(round, self.needs)}
        total, terms = None, []
        for k, (weight, fn, kwargs, reshapes) in enumerate(self.entries):
            if fn is None:
                term = round.scores.rewards.float()  # [B] the task's verifier
            else:
                named = {name: inputs[name] for name in parameters(fn) if name in inputs}
                running = inputs["correct"].float() if k in self.flags else total  # [B] a rule reward, or the sum
                term = fn(**named, **kwargs, **({"rewards": running} if reshapes else {})).float()  # [B]
            total = weight * term if total is None or reshapes else total + weight * term  # [B]
            terms.append(term)
        return total, torch.stack(terms, dim=1)  # [B], [B, K]

    def on_verdict(self, terms: Tensor, correct: Tensor) -> Tensor:
        """The step reward [B] with every verifier term replaced by the 0/1 verdict `correct` [B]: Σ_k w_k·term_k
        over `terms` [B, K] (a pipeline without reshaping entries). AMIR-GRPO mines its pairs on it: its code's
        reward is 2.0 / 0.0 correctness, which its margin 1.5 separates; the task's shaped reward (partial credit
        for a close answer) would leave right-versus-nearly-right pairs under the margin."""
        if self.reshapes:
            raise ValueError("on_verdict: the pipeline has reshaping entries, whose terms depend on the sum so far")
        columns = [correct.float() if fn is None else terms[:, k] for k, (_, fn, _, _) in enumerate(self.entries)]
        return (torch.stack(columns, dim=1) * torch.tensor(self.weights)).sum(1)  # [B]


def _reward_inputs(round: Round) -> dict[str, Any]:
    batch = round.batch
    mask = batch.completion_mask.cpu()  # [B, T]
    return {
        "completions": batch.completions,
        "answers": round.answers,
        "truncated": batch.truncated.cpu(),  # [B]
        "lengths": mask.sum(1).float(),  # [B]
        "correct": verdict(round.scores),  # [B]
        "group_ids": batch.group_ids.cpu(),  # [B]
        "old_logp": batch.sampling_logp.cpu(),  # [B, T]
        "mask": mask,
    }


def _reward_callable(
    entry: ComponentConfig, problems: list[str], produced: RewardInputs
) -> tuple[Callable[..., Tensor] | None, dict[str, Any]]:
    """The reward's function and its hyperparameters (a class is built from them and from what `produced` gives),
    or None after a problem (each input `produced` cannot give on this task, with its reason)."""
    obj = REWARDS.get(entry.name)
    if inspect.isclass(obj):
        unknown = [n for n in required(obj) if n not in produced.constructors]
        if unknown:
            problems.append(f"reward {entry.name!r}: is built from {unknown}, which a preset cannot give")
            return None, {}
        reasons = [f"{n} ({produced.reason(n)})" for n in required(obj) if produced.reason(n)]
        if reasons:
            problems.append(f"reward {entry.name!r}: cannot produce " + ", ".join(reasons))
            return None, {}
        fn, kwargs = obj(**{n: produced.constructors[n] for n in required(obj)}, **entry.kwargs), {}
    else:
        fn, kwargs = obj, entry.kwargs
    needed = [n for n in required(fn) if n not in REWARD_INPUTS and n != "rewards" and n not in kwargs]
    unknown = [n for n in needed if n not in produced.names]
    reasons = [f"{n} ({produced.reason(n)})" for n in needed if n in produced.names and produced.reason(n)]
    if unknown:
        problems.append(f"reward {entry.name!r}: needs {unknown}, which the trainer cannot produce")
    if reasons:
        problems.append(f"reward {entry.name!r}: cannot produce " + ", ".join(reasons))
    return (None, {}) if unknown or reasons else (fn, kwargs)


def parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The named parameters of `fn` (no *args / **kwargs)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind not in variadic}


def required(fn: Callable[..., Any]) -> list[str]:
    """The parameters of `fn` without a default."""
    return [n for n, p in parameters(fn).items() if p.default is inspect.Parameter.empty]

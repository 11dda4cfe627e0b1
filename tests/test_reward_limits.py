"""Rewards under adversarial model output: every adversarial input below (huge numbers, endless unclosed tags and
boxes, giant expressions) finishes within its limit, from the main thread and from worker threads, scores 0 and is
counted as over a limit; extraction stays linear.

The time bounds asserted here are the limits themselves plus slack for a loaded 2-core machine; what each input
costs when measured is in the comments (ms unless said).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grpo_kernels.rewards import countdown, format_reward, gsm8k, limits, math_answer, math_pool
from grpo_kernels.rewards.extraction import answer_tag, last_boxed
from grpo_kernels.rewards.limits import over_limit_count, over_limit_rows
from grpo_kernels.trainer import TrainConfig
from grpo_kernels.trainer.components import PresetComponents
from grpo_kernels.trainer.config import apply_preset
from grpo_kernels.trainer.parallel import ParallelState
from grpo_kernels.trainer.rollout import RolloutBatch
from grpo_kernels.trainer.tasks import AdditionTask, CountdownTask, PromptStream, RewardBatch, build_task
from grpo_kernels.trainer.tasks.jsonl import read_jsonl

math_module = sys.modules["grpo_kernels.rewards.math_answer"]  # the package attribute is the reward function
LIMIT = 1.0  # seconds: the time limit the math cases run under
SLACK = 2.0  # seconds on top of a limit: scheduling on a shared 2-core machine, never a hang
FAST = 1.0  # seconds: the bound for inputs that need no time limit, only linear work (they take a few ms)

BOXED_112K = "\\boxed{" * 16_000  # 112 KB: 159 s before (quadratic last_boxed)
ANSWER_50K = "<answer>" * 50_000  # 400 KB of unclosed tags: > 60 s before (backtracking regex)
COUNTDOWN_800K = "<answer>" + "+".join(["1"] * 400_000) + "</answer>"  # 21 s before (evaluated, then checked)


def run_main(fn):
    return fn()


def run_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join()
    return out["value"]


def run_pool(fn):
    with ThreadPoolExecutor(max_workers=2) as pool:
        return pool.submit(fn).result()


RUNNERS = {"main": run_main, "thread": run_thread, "pool": run_pool}


def scored(runner, reward):
    """(scores, over-limit rows, seconds) of `reward()` run by `runner`, rows collected in the thread that runs it."""

    def call():
        with over_limit_rows() as rows:
            start = time.perf_counter()
            scores = reward()
            return scores, rows, time.perf_counter() - start

    return RUNNERS[runner](call)


@pytest.fixture(scope="module")
def warm_math():
    """A started worker, so that the timed calls measure the verification, not the worker's import (~1 s)."""
    pytest.importorskip("math_verify")
    assert math_answer(["\\boxed{1}"], answers=["1"]).tolist() == [1.0]


ADVERSARIAL = {  # name: (reward call, its time bound in seconds)
    "math_tower": (lambda: math_answer(["\\boxed{10^{10^{10}}}"], answers=["5"]), FAST),  # screened: 0.4
    "math_factorial": (lambda: math_answer(["\\boxed{10000000!}"], answers=["5"]), FAST),  # screened: 0.3
    "math_power_of_power": (  # passes the screen; the worker's timer stops it at the limit
        lambda: math_answer(["\\boxed{(10^{99999})^{99999}}"], answers=["5"], timeout_seconds=LIMIT),
        LIMIT + math_pool.KILL_GRACE_SECONDS + SLACK,
    ),
    "math_boxed_112k": (lambda: math_answer([BOXED_112K], answers=["5"]), FAST),  # over the size cap: 0.4
    "math_answer_50k": (lambda: math_answer([ANSWER_50K], answers=["5"]), FAST),
    "gsm8k_answer_50k": (lambda: gsm8k([ANSWER_50K], answers=["#### 5"]), FAST),
    "format_answer_50k": (lambda: format_reward([ANSWER_50K]), FAST),
    "countdown_800k": (lambda: countdown([COUNTDOWN_800K], targets=[3], numbers=[[1, 1, 1]]), FAST),  # 5
}


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_adversarial_answer_scores_zero_within_its_limit_and_is_counted(case, runner, request):
    reward, bound = ADVERSARIAL[case]
    if case.startswith("math"):
        request.getfixturevalue("warm_math")
    before = over_limit_count()
    scores, rows, seconds = scored(runner, reward)
    assert scores.tolist() == [0.0] and rows == {0}
    assert over_limit_count() == before + 1
    assert seconds < bound, f"{case} took {seconds:.2f} s from {runner}, bound {bound} s"


def test_extraction_is_linear_whatever_the_size_cap():
    # One scan each: 1 MB costs a few ms (~60 ms per 100k braces to match), where the old code was quadratic.
    for text in (BOXED_112K, "\\boxed{" * 150_000, "\\boxed{" + "}{" * 200_000, ANSWER_50K, "{" * 1_000_000):
        start = time.perf_counter()
        last_boxed(text), answer_tag(text)
        assert time.perf_counter() - start < FAST
    assert last_boxed("\\boxed{a}" + "\\boxed{" * 16_000) == "a"  # the last *balanced* box
    assert answer_tag("<answer>a</answer>" + ANSWER_50K) == "a"  # the last *complete* tag


def test_countdown_bounds_the_equation_even_under_a_larger_size_cap(monkeypatch):
    monkeypatch.setattr(limits, "MAX_COMPLETION_CHARS", 10_000_000)
    scores, rows, seconds = scored("pool", lambda: countdown([COUNTDOWN_800K], targets=[3], numbers=[[1, 1, 1]]))
    assert scores.tolist() == [0.0] and rows == {0} and seconds < FAST  # over MAX_EQUATION_CHARS, never evaluated
    # Wrong numbers are found before anything is evaluated: 0, and not over a limit.
    long_product = "<answer>" + "*".join(["9"] * 400) + "</answer>"  # under MAX_EQUATION_CHARS, 400 operands
    scores, rows, _ = scored("main", lambda: countdown([long_product], targets=[3], numbers=[[9, 9, 9]]))
    assert scores.tolist() == [0.0] and rows == set()


def test_math_extraction_of_112k_boxes_is_fast_even_under_a_larger_size_cap(monkeypatch, warm_math):
    monkeypatch.setattr(limits, "MAX_COMPLETION_CHARS", 10_000_000)
    scores, rows, seconds = scored("thread", lambda: math_answer([BOXED_112K, ANSWER_50K], answers=["5", "5"]))
    assert scores.tolist() == [0.0, 0.0] and rows == set() and seconds < FAST  # no answer to extract: plain 0


def test_a_stuck_worker_is_killed_at_the_limit_and_replaced(warm_math):
    # A worker stuck where its own timer cannot reach (here: stopped) is killed KILL_GRACE_SECONDS past the limit.
    with math_pool._POOL.lock:
        worker = math_pool._POOL.idle[-1]
    os.kill(worker.process.pid, signal.SIGSTOP)
    scores, rows, seconds = scored("pool", lambda: math_answer(["\\boxed{5}"], answers=["5"], timeout_seconds=LIMIT))
    assert scores.tolist() == [0.0] and rows == {0}
    assert seconds < LIMIT + math_pool.KILL_GRACE_SECONDS + SLACK
    assert math_answer(["\\boxed{5}", "\\boxed{6}"], answers=["5", "5"]).tolist() == [1.0, 0.0]  # a fresh worker


def test_a_worker_that_died_while_idle_is_restarted(warm_math):
    with math_pool._POOL.lock:
        worker = math_pool._POOL.idle[-1]
    worker.process.kill()
    worker.process.wait()
    scores, rows, _ = scored("main", lambda: math_answer(["\\boxed{1/2}"], answers=["0.5"]))
    assert scores.tolist() == [1.0] and rows == set()


def test_concurrent_callers_get_their_own_verdicts(warm_math):
    completions = ["\\boxed{2}", "\\boxed{3}", "\\boxed{10^{10^{10}}}", "\\boxed{\\frac{1}{2}}"]
    answers = ["2", "2", "2", "0.5"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: scored("main", lambda: math_answer(completions, answers=answers)), range(4)))
    for scores, rows, _ in results:
        assert scores.tolist() == [1.0, 0.0, 0.0, 1.0] and rows == {2}


@pytest.mark.parametrize(
    ("expression", "too_big"),
    [
        ("10^{10^{10}}", True),  # a power tower: 10^(10^10)
        ("9^{9^{9}}", True),
        ("2^{(10^{10})}", True),
        ("9^{99999999}", True),  # an exponent over MAX_EXPONENT
        ("10^{-99999999}", True),
        ("10000000!", True),  # a factorial over MAX_FACTORIAL
        ("2^{10}", False),
        ("2^{2^{3}}", False),  # 2^8: a small tower is fine
        ("2^{2^{n}}", False),  # symbolic: nothing to compute
        ("6.02 \\times 10^{23}", False),
        ("10^{-3}", False),
        ("x^2 + 1", False),
        ("5! + 3!", False),
        ("\\frac{1}{2}", False),
        ("(10^{99999})^{99999}", False),  # not caught by the screen: the time limit stops it
    ],
)
def test_the_screen_stops_huge_numbers_and_passes_ordinary_answers(expression, too_big):
    assert math_module.too_big(expression) is too_big


def test_tasks_report_over_limit_completions_in_their_metrics():
    countdown_task = CountdownTask(eval_size=1)
    answers = [json.dumps({"target": 22, "numbers": [3, 5, 7]})] * 3
    completions = ["3*5+7", COUNTDOWN_800K, "<answer>" + "+".join(["1"] * 600) + "</answer>"]  # ok, too long, too big
    scores = countdown_task.score(completions, answers, torch.zeros(3, dtype=torch.bool))
    assert scores.over_limit.tolist() == [False, True, True]
    assert scores.columns.tolist() == [[1.0, 1.0, 1.0], [0.0] * 3, [0.0] * 3]  # row 2's format is fine: still 0
    addition = AdditionTask().score(["7", "7" * 200_000], ["7", "7"], torch.zeros(2, dtype=torch.bool))
    assert addition.over_limit.tolist() == [False, True] and addition.columns.tolist() == [[1.0] * 3, [0.0] * 3]
    kept = RewardBatch.cat([scores, addition.select(torch.tensor([1]))])  # samplers keep the flags with the rows
    assert kept.over_limit.tolist() == [False, True, True, True]


def test_jsonl_task_counts_a_math_check_over_its_limit(tmp_path, warm_math):
    records = [{"prompt": "q", "answer": "5", "split": "test"}, {"prompt": "r", "answer": "x+1"}]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    task = build_task(Namespace(dataset=str(path), eval_size=1))
    completions = ["\\boxed{10^{10^{10}}}", "\\boxed{1+x}", BOXED_112K]
    scores = task.score(completions, ["5", "x+1", "5"], torch.zeros(3, dtype=torch.bool))
    assert scores.columns[:, 0].tolist() == [0.0, 1.0, 0.0] and scores.over_limit.tolist() == [True, False, True]


def test_jsonl_line_over_the_limit_names_the_line_without_reading_the_rest(tmp_path, monkeypatch):
    jsonl = sys.modules["grpo_kernels.trainer.tasks.jsonl"]
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "big.jsonl"
    fits = json.dumps({"prompt": "p" * 971, "answer": "1"})
    assert len(fits) == 1000  # exactly at the limit
    with path.open("w", encoding="utf-8") as f:
        f.write(fits + "\n" + fits + "x\n" + "x" * 20_000_000)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"big\.jsonl, line 2: longer than 1000 bytes"):
        read_jsonl(path)
    assert time.perf_counter() - start < FAST  # the 20 MB line after it is never read
    path.write_text(fits + "\n" + fits, encoding="utf-8")  # at the limit, with and without a newline
    assert len(read_jsonl(path)[0]) == 1
    path.write_bytes(b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"line 1: not UTF-8"):
        read_jsonl(path)


class OneLongCompletion:
    """A rollout engine whose second completion of each prompt is over the size cap."""

    def generate(self, prompts: list[str], num_generations: int) -> RolloutBatch:
        rows = len(prompts) * num_generations
        completions = ["7" * 200_000 if i % num_generations == 1 else "7" for i in range(rows)]
        return RolloutBatch(
            prompt_ids=torch.full((rows, 1), 5),
            prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
            completion_ids=torch.ones(rows, 2, dtype=torch.long),
            completion_mask=torch.ones(rows, 2, dtype=torch.bool),
            sampling_logp=torch.zeros(rows, 2),
            group_ids=torch.arange(rows) // num_generations,
            completions=completions,
            truncated=torch.zeros(rows, dtype=torch.bool),
        )


@pytest.mark.parametrize("preset", [None, "dapo"])  # dapo: the dynamic sampler selects and concatenates rows
def test_trainer_logs_the_over_limit_count_of_each_step(preset):
    config = dataclasses.replace(apply_preset(TrainConfig(), preset), prompts_per_step=2, num_generations=4)
    parts = PresetComponents(config, AdditionTask(), ParallelState(0, 1, torch.device("cpu"), "none"))
    step = parts.collect(PromptStream(AdditionTask(), seed=0), OneLongCompletion())
    over = len(step.batch.completions) // 4  # one completion in four
    assert step.metrics["rewards/over_limit"] == over and (step.rewards == 0).sum() >= over

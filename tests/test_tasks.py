"""The tasks `build_task` picks by `dataset`: generated Countdown problems are solvable and held out by hash, a local
JSONL file parses (and names its bad lines), GSM8K loads through `datasets` (monkeypatched: no network), every
reward column is hand-checked on literal completions, and the prompt stream replays from its state."""

import json
import sys
from argparse import Namespace
from fractions import Fraction
from itertools import permutations

import pytest
import torch

from grpo_kernels.rewards import REWARDS
from grpo_kernels.trainer import offline as hub
from grpo_kernels.trainer.model import build_tokenizer
from grpo_kernels.trainer.tasks import AdditionTask, CountdownTask, DatasetTask, PromptStream, RewardBatch, build_task
from grpo_kernels.trainer.tasks.countdown import is_held_out
from grpo_kernels.trainer.tasks.jsonl import read_jsonl

NO_TRUNCATION = torch.tensor([False])


def solve(numbers: list[int], target: int) -> str | None:
    """An equation using each number exactly once that equals `target` (exhaustive pairwise search), or None."""

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in permutations(range(len(items)), 2):
            (a, x), (b, y) = items[i], items[j]
            rest = [item for k, item in enumerate(items) if k not in (i, j)]
            options = [(a + b, f"({x}+{y})"), (a - b, f"({x}-{y})"), (a * b, f"({x}*{y})")]
            options += [(a / b, f"({x}/{y})")] if b else []
            for option in options:
                if (found := search([*rest, option])) is not None:
                    return found
        return None

    return search([(Fraction(n), str(n)) for n in numbers])


def encodes_without_unk(task, outputs: list[str] | None = None) -> bool:
    """Every prompt and `outputs` (default: the answers) are in the tiny tokenizer's alphabet, and every prompt fits
    `max_prompt_length`."""
    tokenizer = build_tokenizer(task.alphabet)
    prompts = task.eval_prompts() + task.sample(50, torch.Generator().manual_seed(0))
    ids = tokenizer([p.text for p in prompts] + (outputs or [p.answer for p in prompts]))["input_ids"]
    longest = max(len(row) for row in ids[: len(prompts)])
    return all(tokenizer.unk_token_id not in row for row in ids) and longest <= task.max_prompt_length


# ------------------------------------------------------------------------------------------------------ build_task
def test_build_task_picks_the_dataset_and_rejects_an_unknown_one(tmp_path):
    assert isinstance(build_task(Namespace()), AdditionTask)  # a config without the field: the demo
    assert build_task(Namespace(dataset="addition", max_sum=5)).max_sum == 5
    assert isinstance(build_task(Namespace(dataset="countdown", eval_size=4)), CountdownTask)
    with pytest.raises(ValueError, match=r"\['addition', 'countdown', 'gsm8k'\] or a path ending in .jsonl.*'gsm9k'"):
        build_task(Namespace(dataset="gsm9k"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        build_task(Namespace(dataset=str(tmp_path / "missing.jsonl")))


# --------------------------------------------------------------------------------------------------------- verdict
def test_addition_gives_a_verdict_beside_its_shaped_reward():
    """`correct` is the 0/1 verdict; the shaped reward gives "8" for 7 partial credit, a correctness-based
    component (DAPO's filter, GPG's valid groups) must not read it as right."""
    scores = AdditionTask().score(["7", "8", "x", "7"], ["7"] * 4, torch.tensor([False, False, False, True]))
    assert scores.correct.dtype == torch.bool and scores.correct.tolist() == [True, False, False, True]
    torch.testing.assert_close(scores.rewards, torch.tensor([1.0, 0.28, 0.0, 0.9]))  # 0.7·a + 0.2·c + 0.1·f
    picked = RewardBatch.cat([scores.select(torch.tensor([1, 0])), scores.select(torch.tensor([2]))])
    assert picked.verdict.tolist() == [False, True, False]
    by_hand = RewardBatch(torch.tensor([0.3, 1.0]), torch.tensor([[0.0, 1.0], [1.0, 0.0]]), ("format", "answer"))
    assert by_hand.correct is None and by_hand.verdict.tolist() == [True, False]  # its `answer` column
    with pytest.raises(ValueError, match="no verdict"):
        _ = RewardBatch(torch.zeros(1), torch.zeros(1, 1), ("format",)).verdict


# ------------------------------------------------------------------------------------------------------- countdown
def test_countdown_prompts_are_solvable_and_a_solution_scores_full_marks():
    task = CountdownTask(eval_size=8)
    prompts = task.sample(24, torch.Generator().manual_seed(0)) + task.eval_prompts()
    solutions = []
    for prompt in prompts:
        problem = json.loads(prompt.answer)
        assert prompt.text == f"Using {' '.join(map(str, problem['numbers']))} reach {problem['target']}:"
        assert 3 <= len(problem["numbers"]) <= 4 and 1 <= problem["target"] <= 99
        solution = solve(problem["numbers"], problem["target"])
        assert solution is not None, f"{prompt.text} has no solution"
        solutions.append(solution)
    problems = [json.loads(p.answer) for p in prompts]
    targets, numbers = [p["target"] for p in problems], [p["numbers"] for p in problems]
    tagged = [f"<answer>{s}</answer>" for s in solutions]
    assert REWARDS.get("countdown")(tagged, targets=targets, numbers=numbers).eq(1.0).all()
    scores = task.score(solutions, [p.answer for p in prompts], torch.zeros(len(prompts), dtype=torch.bool))
    assert scores.rewards.eq(1.0).all()


def test_countdown_rewards_by_hand():
    task = CountdownTask()
    answer = json.dumps({"target": 46, "numbers": [3, 7, 25]})
    completions = ["7*3+25", "<answer>25 + 3*7</answer>", "(25-7)*3", "3*7+25", "7*3+2", "seven"]
    truncated = torch.tensor([False, False, False, True, False, False])
    scores = task.score(completions, [answer] * len(completions), truncated)
    expected = [  # answer, closeness, format
        [1.0, 1.0, 1.0],  # 21 + 25 = 46
        [1.0, 1.0, 1.0],  # the same in an <answer> tag
        [0.0, 0.2, 1.0],  # 54: uses every number once, 8 off -> 1 - 8/10
        [1.0, 1.0, 0.0],  # right, but no <eos> within the budget
        [0.0, 0.0, 1.0],  # 2 is not one of the numbers (and 25 is left out)
        [0.0, 0.0, 0.0],  # not an equation
    ]
    assert scores.names == ("answer", "closeness", "format")
    torch.testing.assert_close(scores.columns, torch.tensor(expected))
    torch.testing.assert_close(scores.rewards, scores.columns @ torch.tensor([0.7, 0.2, 0.1]))
    assert scores.correct.tolist() == [True, True, False, True, False, False]  # the 0/1 verdict beside the shaping


def test_countdown_eval_set_is_fixed_and_never_drawn_for_training():
    task = CountdownTask(eval_size=32)
    held_out = task.eval_prompts()
    assert held_out == CountdownTask(eval_size=32).eval_prompts()  # the same set in every run
    assert len({p.text for p in held_out}) == 32 and all(is_held_out(p.text) for p in held_out)
    train = task.sample(3000, torch.Generator().manual_seed(1))
    assert not {p.text for p in train} & {p.text for p in held_out}
    assert not any(is_held_out(p.text) for p in train)
    assert encodes_without_unk(task, ["(25 - 7) * 3 / 2", "99+1"])  # prompts and equations; the answer is JSON


# ------------------------------------------------------------------------------------------------------------ jsonl
def write_jsonl(path, records) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_splits_explicit_or_last_tenth(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": f"{i}*2=", "answer": 2 * i} for i in range(20)])
    train, test = read_jsonl(plain)
    assert [p.text for p in test] == ["18*2=", "19*2="] and len(train) == 18 and train[0].answer == "0"
    split = [{"prompt": "a", "answer": "1", "split": "test"}, {"prompt": "b", "answer": "2"}, ""]
    split.append({"prompt": "c", "answer": "3", "split": "train"})
    train, test = read_jsonl(write_jsonl(tmp_path / "split.jsonl", split))
    assert ([p.text for p in train], [p.text for p in test]) == (["c", "b"], ["a"])  # blank lines are skipped
    few = write_jsonl(tmp_path / "few.jsonl", [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}])
    assert [p.text for p in read_jsonl(few)[1]] == ["y"]  # at least one held out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{'prompt': 1}", "line 2: not valid JSON"),
        ('["prompt", "answer"]', "line 2: must be a JSON object, got list"),
        ('{"prompt": "q"}', r"line 2: missing key\(s\) \['answer'\]"),
        ('{"prompt": "q", "answer": ""}', "line 2: 'answer' must be a non-empty string"),
        ('{"prompt": "q", "answer": "1", "split": "dev"}', "line 2: 'split' must be one of"),
    ],
)
def test_jsonl_bad_lines_name_the_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, line])
    with pytest.raises(ValueError, match=message):
        build_task(Namespace(dataset=path))


def test_jsonl_task_rewards_alphabet_and_disjoint_splits(tmp_path):
    records = [{"prompt": "half of 1?", "answer": "1/2", "split": "test"}, {"prompt": "capital?", "answer": "Paris"}]
    records += [{"prompt": "half of 1?", "answer": "1/2", "split": "train"}, {"prompt": "6*7=", "answer": 42}]
    task = build_task(Namespace(dataset=write_jsonl(tmp_path / "mixed.jsonl", records), eval_size=1))
    assert isinstance(task, DatasetTask) and task.name == "mixed"
    assert [p.text for p in task.eval_prompts()] == ["half of 1?"]
    assert {p.text for p in task.train} == {"capital?", "6*7="}  # the train copy of a test prompt is dropped
    assert {p.text for p in task.sample(20, torch.Generator().manual_seed(0))} == {"capital?", "6*7="}
    assert encodes_without_unk(task)
    cases = [  # completion, answer, (answer, format)
        ("42", "42", (1.0, 1.0)),
        (" 42.0 ", "42", (1.0, 1.0)),  # the same decimal number
        ("41", "42", (0.0, 1.0)),
        ("Paris", "Paris", (1.0, 1.0)),
        ("paris", "Paris", (0.0, 1.0)),  # text must match exactly
        ("I think <answer>0.5</answer>", "1/2", (1.0, 1.0)),  # math-verify: 0.5 = 1/2
        ("so \\boxed{\\frac{1}{2}}", "1/2", (1.0, 1.0)),
        ("1/3", "1/2", (0.0, 1.0)),
        ("", "42", (0.0, 0.0)),
    ]
    completions, answers, expected = (list(column) for column in zip(*cases, strict=True))
    scores = task.score(completions, answers, torch.zeros(len(cases), dtype=torch.bool))
    torch.testing.assert_close(scores.columns, torch.tensor(expected))
    torch.testing.assert_close(scores.rewards, scores.columns @ torch.tensor([0.9, 0.1]))
    assert scores.correct.tolist() == [c[0] == 1.0 for c in expected]
    assert task.score(["42"], ["42"], torch.tensor([True])).columns.tolist() == [[1.0, 0.0]]  # cut off: no format


# ------------------------------------------------------------------------------------------------------------ gsm8k
def fake_gsm8k(monkeypatch) -> list:
    """Replace `datasets.load_dataset` by a two-split in-memory GSM8K, on a Hub that answers; returns the arguments
    it was called with."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(hub, "offline_reason", lambda: None)
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append(args)
        split = lambda numbers: datasets.Dataset.from_dict(  # noqa: E731
            {
                "question": [f"Tom has {i} apples and buys {i}. How many?" for i in numbers],
                "answer": [f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i:,}" for i in numbers],
            }
        )
        return datasets.DatasetDict(train=split([3, *range(1000, 1005)]), test=split(range(1000)))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_gsm8k_loads_through_datasets_and_scores_the_final_number(monkeypatch):
    calls = fake_gsm8k(monkeypatch)
    task = build_task(Namespace(dataset="gsm8k", eval_size=5))
    assert calls == [("openai/gsm8k", "main")]
    assert task.name == "gsm8k" and task.reward_names == ("answer", "format")
    held_out = task.eval_prompts()
    assert [p.text for p in held_out][:2] == [
        "Question: Tom has 0 apples and buys 0. How many?\nAnswer:",
        "Question: Tom has 1 apples and buys 1. How many?\nAnswer:",
    ]
    assert len(held_out) == 5 and held_out[1].answer.endswith("#### 2")
    assert len(task.train) == 5 and "Tom has 3 apples" not in task.train[0].text  # a test prompt is not trained on
    assert encodes_without_unk(task)
    answer = "600 + 600 = <<600+600=1200>>1200\n#### 1,200"
    completions = ["600 + 600 = 1,200", "<answer>1200</answer> (not 7)", "1201", "twelve hundred", "1200"]
    truncated = torch.tensor([False, False, False, False, True])
    scores = task.score(completions, [answer] * 5, truncated)
    expected = [[1.0, 1.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]  # answer, format
    torch.testing.assert_close(scores.columns, torch.tensor(expected))
    assert scores.correct.tolist() == [True, True, False, False, True]


def test_gsm8k_without_the_hub_or_datasets_says_so(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(hub, "offline_reason", lambda: None)  # the Hub answers; the library's load fails
    with pytest.raises(ConnectionError, match=r"could not load 'openai/gsm8k' from the Hugging Face hub.*\.jsonl"):
        build_task(Namespace(dataset="gsm8k"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"needs the `datasets` library.*\.jsonl"):
        build_task(Namespace(dataset="gsm8k"))


# ---------------------------------------------------------------------------------------------------- prompt stream
@pytest.mark.parametrize("task", [AdditionTask(), CountdownTask(eval_size=1)], ids=lambda t: t.name)
def test_prompt_stream_replays_from_its_state(task):
    stream = PromptStream(task, seed=3)
    stream.next(5)
    state = stream.state_dict()
    ahead = stream.next(7)
    restored = PromptStream(task, seed=99)
    restored.load_state_dict(state)
    assert restored.next(7) == ahead
    assert PromptStream(task, seed=3).next(12) == PromptStream(task, seed=3).next(12)
    assert PromptStream(task, seed=3).next(12) != PromptStream(task, seed=4).next(12)

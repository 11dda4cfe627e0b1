"""`gsm8k`: grade-school math word problems (Cobbe et al., arXiv:2110.14168) from the Hugging Face hub.

`datasets.load_dataset("openai/gsm8k", "main")`: 7,473 train and 1,319 test problems. Prompt
`"Question: <question>\\nAnswer:"`; the answer field is the dataset's worked solution, ending `#### <number>`.
Columns: `answer` is `REWARDS["gsm8k"]` (the last number of the completion, or of its `<answer>` tag, equals the
number after `####`); `format` is 1 when the completion has a number and ended with `<eos>`.
"""

from __future__ import annotations

from torch import Tensor

from grpo_kernels.checks import check_texts
from grpo_kernels.rewards import REWARDS
from grpo_kernels.rewards.extraction import last_number
from grpo_kernels.rewards.limits import score_texts
from grpo_kernels.trainer.offline import require_hub
from grpo_kernels.trainer.tasks.dataset import DatasetTask
from grpo_kernels.trainer.tasks.records import EVAL_SIZE, Prompt

HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
_LOCAL = 'or pass --dataset path/to/file.jsonl with one {"prompt": ..., "answer": ...} object per line'


def number_present(completions: list[str], truncated: Tensor, **kwargs) -> Tensor:
    """1.0 where the completion has a number and ended with `<eos>` (not `truncated`), else 0.0. [B] float32."""
    completions = check_texts("completions", completions)
    has_number = score_texts(lambda c: last_number(c) is not None, completions).bool()  # [B]
    return (has_number & ~truncated.cpu()).float()


def require_gsm8k() -> None:
    """An OSError at once when GSM8K can come neither from the Hub nor from its cache (`offline.require_hub`)."""
    require_hub("dataset 'gsm8k'", HUB_NAME, "dataset", "use a local file instead: " + _LOCAL.removeprefix("or "))


def load_gsm8k(eval_size: int = EVAL_SIZE) -> DatasetTask:
    """GSM8K's train split for training, the first `eval_size` problems of its test split for evaluation."""
    require_gsm8k()
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"dataset 'gsm8k' needs the `datasets` library: pip install datasets ({_LOCAL})") from error
    try:
        splits = datasets.load_dataset(HUB_NAME, HUB_CONFIG)
    except Exception as error:  # offline, hub down, no access: many error types, one cause to report
        raise ConnectionError(  # an OSError: the CLI's one-line user error
            f"could not load {HUB_NAME!r} from the Hugging Face hub ({type(error).__name__}: {error}); check the "
            f"network or the datasets cache (HF_DATASETS_OFFLINE=1 uses a cached copy), {_LOCAL}"
        ) from error
    train, test = (
        [Prompt(f"Question: {q}\nAnswer:", a) for q, a in zip(splits[s]["question"], splits[s]["answer"], strict=True)]
        for s in ("train", "test")
    )
    return DatasetTask("gsm8k", train, test, REWARDS.get("gsm8k"), number_present, eval_size)

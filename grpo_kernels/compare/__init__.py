"""`python -m grpo_kernels.compare`: train several paper presets on one task with the same seed and budget, and
measure them side by side.

Each preset is one trainer run (`grpo_kernels.trainer`, its own run directory `<output_dir>/<preset>/` with the
trainer's rules), in its own process so that its peak memory is its own. The results are one table
(`compare.md`, `compare.json`: final reward, steps to a reward threshold, greedy accuracy, tokens/s, peak memory)
and one plot of the reward curves (`compare.svg`, written without matplotlib).
"""

from grpo_kernels.compare.report import RunSummary, summarize
from grpo_kernels.compare.runs import CompareConfig, compare

__all__ = ["CompareConfig", "RunSummary", "compare", "summarize"]

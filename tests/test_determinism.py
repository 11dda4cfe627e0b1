"""The same seed and training options give the same numbers whatever the checkpoint, evaluation, logging and
progress options: saving a checkpoint (the initial one at step 0 included) and evaluating never touch the optimizer
or the random stream of training."""

from pathlib import Path

from grpo_kernels.trainer import train
from grpo_kernels.trainer.config import parse_args
from grpo_kernels.trainer.logging import TIMES

# dapo (a fresh AdamW state at step 1, dynamic sampling drawing from the random stream) on lone-digit answers, which
# the tiny policy gets right often enough for the filter to keep groups
RUN = ["--preset", "dapo", "--steps", "3", "--prompts-per-step", "4", "--num-generations", "4"]
RUN += ["--max-completion-length", "1", "--no-plot", "--no-progress"]
TIMING = TIMES


def training_numbers(output_dir: Path, *flags: str) -> list[dict]:
    """Every step's metrics but its timing and its evaluation."""
    history = train(parse_args([*RUN, "--output-dir", str(output_dir), *flags]))
    return [{k: v for k, v in m.items() if k not in TIMING and not k.startswith("eval/")} for m in history]


def test_checkpoint_and_eval_options_leave_the_numbers_unchanged(tmp_path):
    """The initial checkpoint used to create AdamW's state with a zero-gradient step (torch's state-dict helper),
    which shifted its bias correction: `--checkpoint-every 0` changed the rewards from step 2 on."""
    default = training_numbers(tmp_path / "default")
    assert len(default) == 3
    for name, flags in {
        "no_checkpoints": ("--checkpoint-every", "0"),
        "every_step": ("--checkpoint-every", "1", "--eval-every", "1"),
        "logging": ("--eval-every", "2", "--progress-every", "1", "--checkpoint-every", "2"),
    }.items():
        assert training_numbers(tmp_path / name, *flags) == default, name


def test_the_demo_is_the_grpo_preset(tmp_path):
    """The demo (no --preset) and `--preset grpo` train alike: the preset only writes the advantages' ε, at its
    default, into the run's config."""
    small = ["--steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--no-plot", "--no-progress"]

    def numbers(name: str, *flags: str) -> list[dict]:
        history = train(parse_args([*small, "--output-dir", str(tmp_path / name), *flags]))
        return [{k: v for k, v in m.items() if k not in TIMING} for m in history]

    assert numbers("preset", "--preset", "grpo") == numbers("demo")

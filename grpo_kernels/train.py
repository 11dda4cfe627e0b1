"""`python -m grpo_kernels.train [flags]`: the trainer's command line (see grpo_kernels/trainer/config/)."""

from grpo_kernels.trainer.__main__ import main

if __name__ == "__main__":
    main()

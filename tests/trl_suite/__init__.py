"""Runs TRL's own GRPO test file offline on stand-ins, with stock TRL and the drop-in: python -m tests.trl_suite."""

"""The engine: one frozen plan per call (`plan.py`) that checks it, lays its rows out, chooses its route and runs it
(`routes.py`) on the kernels of `grpo_kernels.kernels` and the loss algebra of `grpo_kernels.losses`."""

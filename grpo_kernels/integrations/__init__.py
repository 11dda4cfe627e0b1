"""Integrations with other libraries: Hugging Face models (`hf`), TRL's GRPOTrainer (`trl`), verl (`verl`).

Each module imports its library lazily or behind a guard, so `import grpo_kernels` never needs them.
"""

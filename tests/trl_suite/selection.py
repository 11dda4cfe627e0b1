"""The tests of TRL's GRPO test file that CI runs, stock and drop-in: the loss and its types, the log-probs, PEFT,
gradient accumulation, several iterations, the KL and importance sampling."""

CI: tuple[str, ...] = ()

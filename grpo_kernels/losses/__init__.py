"""GRPO-family loss algebra on per-token [B, T] tensors: the specification and the CPU path of every variant."""

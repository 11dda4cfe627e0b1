"""Benchmark sizes: `--bench-size smoke` (CI correctness run), `cpu` (deliberate CPU runs), `gpu` (real sizes),
`gpu-short` (three of the real sizes, for a short GPU call)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

T = 256  # completion length; N = B·T tokens


@dataclass(frozen=True)
class Shape:
    N: int  # tokens
    V: int  # vocabulary
    H: int  # hidden size (the fused-linear cases)
    dtype: torch.dtype
    loss: str = "dapo"  # grpo, dapo, or gspo (grpo at importance_sampling_level="sequence")

    @property
    def B(self) -> int:
        return max(1, self.N // T)

    @property
    def T(self) -> int:
        return min(self.N, T)

    @property
    def name(self) -> str:
        return f"{self.loss}-n{self.N}-v{self.V}-h{self.H}-{str(self.dtype).removeprefix('torch.')}"

    def measured_by(self, bench: str) -> bool:
        """Whether `bench` depends on all of this shape: the logits-level loss never sees H (its logits are given),
        the log-prob pass has no loss type, so each runs only the shapes that differ in what it does see."""
        if bench == "grpo_loss":
            return self.H == min(s.H for s in SIZES[self.size])
        if bench == "token_logprobs":
            return self.loss == "dapo"
        return True

    @property
    def size(self) -> str:
        return next(size for size, shapes in SIZES.items() if self in shapes)

    def loss_options(self) -> dict:
        if self.loss == "gspo":
            return dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
        return dict(loss_type=self.loss, epsilon_high=0.28, beta=0.04)


F32, BF16 = torch.float32, torch.bfloat16
SIZES = {
    "smoke": [Shape(64, 1000, 32, F32), Shape(64, 1000, 32, F32, "gspo")],
    "cpu": [
        *(Shape(n, v, 896, F32) for n in (512, 2048) for v in (32000, 128256, 151936)),
        Shape(512, 128256, 4096, F32),
        Shape(512, 151936, 896, F32, "grpo"),
        Shape(512, 151936, 896, F32, "gspo"),
    ],
    "gpu": [
        *(Shape(n, v, h, BF16) for n in (1024, 4096, 16384) for v in (32000, 128256, 151936) for h in (896, 4096)),
        Shape(8192, 151936, 4096, BF16),  # the GPU case of the TRL comparison
        Shape(16384, 151936, 4096, BF16, "grpo"),
        Shape(16384, 151936, 4096, BF16, "gspo"),
    ],
    # the suites cut to fit the second plan of run_gpu.sh: Qwen's vocabulary at 4k and 16k tokens, both hidden sizes
    "gpu-short": [
        Shape(4096, 151936, 896, BF16),
        Shape(16384, 151936, 896, BF16),
        Shape(16384, 151936, 4096, BF16),
    ],
}

# The case each size compares against TRL 1.16 (`python -m benchmarks.interleaved`; the CPU bar: fp32,
# N = 2,048 completion tokens, H = 896, V = 151,936, dapo, beta = 0.04)
TRL_CASES = {"smoke": SIZES["smoke"][0], "cpu": Shape(2048, 151936, 896, F32), "gpu": Shape(8192, 151936, 4096, BF16)}

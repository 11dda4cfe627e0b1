"""A GRPO step with the teacher term (on-policy distillation mixed in: `teacher_kl_coef` > 0, reverse KL) against the
plain GRPO step, both `fused_linear_grpo_loss` forward + backward (dapo, on-policy) on the same student, in the same
run. The plain step runs 3 GEMMs of the student's head per chunk of rows; with the teacher term the GRPO loss is formed
inside the two-head divergence's pass: 4 (the teacher's logits GEMM added), plus the divergence's vocabulary sweeps.
Target: ≤ 1.6× the plain step at N 2,048, H 896, V 151,936, fp32."""

import pytest
import torch

from benchmarks import divergence_cases

PROVIDERS = ("grpo", "grpo_with_teacher")
SIZES = {"smoke": (64, 32, 1000), "cpu": (2048, 896, 151936), "gpu": (2048, 896, 151936)}
SEQUENCES = 8  # the N tokens as [8, N / 8] completions, every token kept


def step(provider: str, data: dict, sequences: int):
    """A callable running one forward + backward of `provider` (the student's gradients reset first)."""
    from grpo_kernels import fused_linear_grpo_loss

    hidden, weight = data["student_hidden"], data["student_weight"]
    N = hidden.shape[0]
    batch = hidden.view(sequences, N // sequences, -1)  # [B, T, H], a view: its gradient reaches the leaf
    targets = torch.randint(0, weight.shape[0], (sequences, N // sequences), generator=torch.Generator().manual_seed(1))
    advantages = torch.linspace(-1.0, 1.0, sequences)
    teacher = {}
    if provider == "grpo_with_teacher":
        teacher = dict(teacher_hidden=data["teacher_hidden"].view(sequences, N // sequences, -1),
                       teacher_weight=data["teacher_weight"], teacher_kl_coef=0.5)  # fmt: skip
    device = hidden.device

    def run() -> None:
        hidden.grad = weight.grad = None
        loss = fused_linear_grpo_loss(batch, weight, targets.to(device), advantages.to(device), loss_type="dapo",
                                      **teacher).loss  # fmt: skip
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_teacher_term(benchmark, bench_size, provider):
    size = bench_size if bench_size in SIZES else "smoke"
    N, H, V = SIZES[size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = step(provider, divergence_cases.inputs(N, H, V, device), SEQUENCES)
    benchmark.extra_info.update(N=N, H=H, V=V, dtype="float32", provider=provider, device=str(device))
    benchmark.pedantic(run, rounds=3 if size == "gpu" else 1, warmup_rounds=0)

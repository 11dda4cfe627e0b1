"""grpo_kernels.integrations.trl.DistillationTrainer against stock `trl.DistillationTrainer` (TRL 1.16): 2 optimizer
steps with on-policy HF generation on tiny models (a student and a wider teacher built from configs, the demo's
character-level tokenizer), same seed: every logged number but the timings agrees, for each divergence; and the drop-in
loss is what TRL's `_chunked_divergence_loss` returns on the same tensors."""

import math
import tempfile
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.integrations.trl_distillation import chunked_divergence_loss  # noqa: E402
from grpo_kernels.trainer.model import build_tokenizer  # noqa: E402

TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
OUTPUT_DIR = str(Path(tempfile.gettempdir()) / "grpo_kernels_test_trl_distillation")  # nothing is saved


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student path, teacher path, tokenizer): tiny Qwen2 models over one vocabulary, the teacher wider."""
    tokenizer = build_tokenizer("abcdefghij")
    root = tmp_path_factory.mktemp("distillation_models")
    for name, hidden in (("student", 32), ("teacher", 48)):
        config = transformers.Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        torch.manual_seed(len(name))
        transformers.Qwen2ForCausalLM(config).save_pretrained(root / name)
    return str(root / "student"), str(root / "teacher"), tokenizer


def _train(cls, models, beta: float, batch: int = 4):
    student, teacher, tokenizer = models
    args = trl.DistillationConfig(
        output_dir=OUTPUT_DIR, per_device_train_batch_size=batch, max_completion_length=8, max_steps=2, logging_steps=1,
        learning_rate=1e-2, beta=beta, temperature=0.9, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        seed=0,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"prompt": ["abc", "de", "fgh", "ij"]})
    trainer = cls(student, teacher_model=teacher, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("beta", (0.0, 1.0))  # the JSD (0.5): under DDP below
def test_two_steps_log_the_same_numbers_as_stock_trl(models, beta, launches):
    stock = _train(trl.DistillationTrainer, models, beta).state.log_history
    assert not launches  # stock TRL never runs the fused pass
    ours = _train(drop_in.DistillationTrainer, models, beta).state.log_history
    assert launches["torch"] >= 2  # the drop-in's loss ran, at least once per step
    assert_same_logs(stock, ours)


def assert_same_logs(stock: list[dict], ours: list[dict]) -> None:
    """Two steps' log histories: the same names, and every number but the timings equal."""
    assert len(stock) == len(ours) == 3  # 2 steps + the train summary
    assert "loss" in stock[0] and "entropy" in stock[0] and "grad_norm" in stock[0]
    for a, b in zip(stock, ours, strict=True):
        assert set(a) == set(b), f"logged names differ: {set(a) ^ set(b)}"
        for name, value in a.items():
            if name not in TIMING:
                assert math.isclose(b[name], value, rel_tol=1e-4, abs_tol=1e-6), f"{name}: {b[name]} != {value}"


def _data_parallel_worker(rank: int, store: str, queue, student: str, teacher: str) -> None:
    """One of 2 CPU processes under accelerate's DDP (gloo): stock TRL and the drop-in, 2 steps each."""
    import os
    import traceback

    from grpo_kernels.kernels import backend as backends
    from tests.rendezvous import join

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        join(rank, 2, store)
        models = (student, teacher, build_tokenizer("abcdefghij"))
        stock = _train(trl.DistillationTrainer, models, 0.5, batch=2)  # 2 of the 4 prompts on each rank
        backends.launches.clear()
        ours = _train(drop_in.DistillationTrainer, models, 0.5, batch=2)
        assert backends.launches["torch"] >= 2, "the drop-in's loss did not run"
        assert stock.accelerator.num_processes == ours.accelerator.num_processes == 2
        assert_same_logs(stock.state.log_history, ours.state.log_history)
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001  reported to the test, which fails with it
        queue.put((rank, traceback.format_exc()))


def test_data_parallel_training_matches_stock_trl(models):
    """2 processes (accelerate's DDP over gloo, each its share of the prompts): the same logs as stock TRL's."""
    from tests.rendezvous import spawn_ranks

    spawn_ranks(_data_parallel_worker, 2, models[0], models[1])


def test_the_drop_in_loss_is_trls_on_the_same_tensors():
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(0)
    s_h, t_h = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 12, generator=g)
    s_w, t_w = torch.randn(50, 8, generator=g), torch.randn(50, 12, generator=g)
    mask = (torch.rand(2, 5, generator=g) > 0.3).float()
    theirs = _chunked_divergence_loss(s_h, t_h, s_w, t_w, mask, 0.5, num_items_in_batch=7, temperature=0.8)
    ours = chunked_divergence_loss(s_h, t_h, s_w, t_w, mask, 0.5, num_items_in_batch=7, temperature=0.8)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def _fsdp2_worker(rank: int, store: str, queue) -> None:
    """One of 2 gloo ranks holding each head as a DTensor sharded over the vocabulary (25 of 50 rows each, as FSDP2
    holds them; the teacher's frozen, as TRL holds it), with hidden states of its own: TRL's loss and the drop-in's,
    each gathering each head with one full_tensor, give the same loss, entropy, count and student gradients (the
    head's a DTensor again, sharded as before)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from tests.rendezvous import run_rank

    def checks() -> None:
        torch.set_num_threads(1)
        heads_g, g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + rank)
        heads = [torch.randn(50, 8, generator=heads_g), torch.randn(50, 12, generator=heads_g)]  # the same on each rank
        s_h, t_h = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 12, generator=g)
        mask = (torch.rand(2, 5, generator=g) > 0.3).float()
        mesh = init_device_mesh("cpu", (2,))
        results, gathers, full_tensor = [], [], DTensor.full_tensor
        for loss_fn in (_chunked_divergence_loss, chunked_divergence_loss):
            s_w, t_w = (distribute_tensor(x.clone(), mesh, [Shard(0)]) for x in heads)
            assert s_w.to_local().shape == (25, 8) and t_w.to_local().shape == (25, 12)
            s_w.requires_grad_()
            hidden = s_h.clone().requires_grad_()
            gathers.clear()
            DTensor.full_tensor = lambda self: gathers.append(1) or full_tensor(self)
            try:
                loss, entropy, count = loss_fn(hidden, t_h, s_w, t_w, mask, 0.5, num_items_in_batch=7, temperature=0.8)
                loss.backward()
            finally:
                DTensor.full_tensor = full_tensor
            assert len(gathers) == 2 and isinstance(s_w.grad, DTensor) and t_w.grad is None
            assert s_w.grad.placements == (Shard(0),)
            results.append((loss, entropy, count, hidden.grad, s_w.grad.full_tensor()))
        for a, b in zip(results[1], results[0], strict=True):
            assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)

    run_rank(rank, 2, store, queue, checks)


def test_fsdp2_dtensor_heads_are_gathered_once_each():
    """FSDP2's sharded heads on 2 CPU processes (gloo): see `_fsdp2_worker`."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    from tests.rendezvous import spawn_ranks

    spawn_ranks(_fsdp2_worker, 2)

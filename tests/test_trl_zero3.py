"""The TRL drop-in under DeepSpeed ZeRO-3: 2 CPU processes (torchrun, gloo, DeepSpeed's CPU accelerator) run
tests/trl_zero3_ranks.py once; the tests read what each rank wrote.

- Stock `trl.GRPOTrainer` and the drop-in train a tiny Qwen2 2 steps each (beta 0, and beta > 0 with a reference
  model): the same logged loss and grad_norm, the same parameters and updates (SGD: updates linear in the
  gradients).
- Ranks with different row counts (one row per chunk) make the same collectives through every route of the fused
  head, inside the DeepSpeed engine's forward, and finish (a hang fails the launch's timeout).
- Stock `trl.DistillationTrainer` and its drop-in distill a wider tiny teacher into it 2 steps each (the JSD; both
  heads partitioned, the teacher's outside any forward of its own): the same logs, parameters and updates, and the
  same one gather per loss call, the heads partitioned again after.
- `zero3.gathered` on an lm_head no module hook gathers: one gather per forward, one more in the backward of the
  routes that read the weight there (4-GEMM, lean), none in the 3-GEMM route's, also on a rank that keeps no row;
  gradients as on the whole weight; a head another owner holds gathered is neither gathered nor released.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from grpo_kernels.trainer.model import build_tokenizer  # noqa: E402
from tests.conftest import assert_close  # noqa: E402
from tests.test_trl import MODELS  # noqa: E402
from tests.test_trl import _sizes as model_sizes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 300  # seconds: far above a normal run (~45 s on 2 cores); a hang ends here
METRIC_TOL = dict(rel_tol=1e-5, abs_tol=1e-6)
BETAS = (0.0, 0.04)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the 2 ranks once; returns (their output directory, the initial parameters)."""
    root = tmp_path_factory.mktemp("trl_zero3")
    tokenizer = build_tokenizer("abcdefghij")
    torch.manual_seed(0)
    model = MODELS["qwen2"](tokenizer)
    model.save_pretrained(root / "model")
    torch.manual_seed(1)  # the teacher: wider, over the same vocabulary
    config = transformers.Qwen2Config(**{**model_sizes(tokenizer), "hidden_size": 48})
    transformers.Qwen2ForCausalLM(config).save_pretrained(root / "teacher")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # its own port
    command += [str(ROOT / "tests" / "trl_zero3_ranks.py"), str(root)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    return root, initial


def _read(root: Path, name: str, rank: int) -> dict:
    return json.loads((root / f"{name}_{rank}.json").read_text())


@pytest.mark.parametrize("beta", BETAS)
def test_training_matches_stock_trl(ranks, beta):
    root, initial = ranks
    logs = _read(root, "train", 0)
    stock, ours = logs[f"stock_{beta}"], logs[f"drop_in_{beta}"]
    assert len(stock) == len(ours) == 2
    for step_a, step_b in zip(stock, ours, strict=True):
        assert set(step_a) == set(step_b) == {"loss", "grad_norm", "entropy", *(["kl"] if beta else [])}
        for name in step_a:
            assert math.isclose(step_b[name], step_a[name], **METRIC_TOL), f"{name}: {step_b[name]} != {step_a[name]}"
    assert logs == _read(root, "train", 1), "the ranks logged different numbers"
    assert_same_training(torch.load(root / f"stock_{beta}.pt"), torch.load(root / f"drop_in_{beta}.pt"), initial)


def assert_same_training(params_a: dict, params_b: dict, initial: dict) -> None:
    """Two trainings' final parameters agree, and so do their updates, up to the rounding of the parameters they
    were added to (a few float32 ulps)."""
    assert set(params_a) == set(params_b) == set(initial)
    for name, start in initial.items():
        assert_close(params_b[name], params_a[name], torch.float32, name)
        update_a, update_b = params_a[name] - start, params_b[name] - start
        assert update_a.abs().max() > 0, f"{name} did not move"
        slack = 4 * torch.finfo(torch.float32).eps * params_a[name].abs().max()
        error = (update_b - update_a).abs().max()
        assert error <= 1e-5 * update_a.abs().max() + slack, f"{name}: update error {error:.3g}"


def test_distillation_matches_stock_trl(ranks):
    root, initial = ranks
    logs = _read(root, "distill", 0)
    stock, ours = logs["stock"], logs["drop_in"]
    assert len(stock) == len(ours) == 2
    for step_a, step_b in zip(stock, ours, strict=True):
        assert {"loss", "grad_norm", "entropy"} <= set(step_a) and set(step_a) == set(step_b)
        for name in step_a:
            assert math.isclose(step_b[name], step_a[name], **METRIC_TOL), f"{name}: {step_b[name]} != {step_a[name]}"
    assert logs == _read(root, "distill", 1), "the ranks logged different numbers"
    # each loss call gathers the teacher's head once (the engine's forward holds the student's), as stock TRL's
    assert logs["drop_in/loss_calls"] == logs["stock/loss_calls"] == [["all_gather_into_tensor"]] * 2
    assert logs["drop_in/partitioned_after"] == [True, True], "a head was left gathered"
    assert_same_training(torch.load(root / "distill_stock.pt"), torch.load(root / "distill_drop_in.pt"), initial)


def test_unequal_rows_make_the_same_collectives(ranks):
    root, _ = ranks
    a, b = _read(root, "collectives", 0), _read(root, "collectives", 1)
    assert a.pop("rows") != b.pop("rows")
    assert a.keys() == b.keys() and len(a) == 4  # 3 loss routes and the log-prob pass
    for case, calls in a.items():
        assert calls == b[case], case
        assert "all_gather_into_tensor" in calls["forward"], case  # ZeRO-3 really gathered parameters


def test_partitioned_head_is_gathered_once_per_pass(ranks):
    root, _ = ranks
    a, b = _read(root, "partitioned", 0), _read(root, "partitioned", 1)
    assert a["partitioned_after"] and b["partitioned_after"], "the head was left gathered"
    assert a["held"] == b["held"] == {"calls": [], "still_gathered": True}  # gathered already: left as it was
    for route in ("three_gemm", "four_gemm", "lean"):
        for case in (route, f"{route}/masked"):  # masked: no row kept on rank 0
            for out in (a, b):
                assert out[case]["error"] == 0.0 and out[case]["loss"] == 0.0, case
            assert a[case]["forward"] == b[case]["forward"] == ["all_gather_into_tensor"] * 2, case  # weight, bias
            backward = [] if route == "three_gemm" else a[case]["forward"]
            assert a[case]["backward"] == b[case]["backward"] == backward, case

"""benchmarks/run_gpu.sh, the one command for a GPU: its dry run on the CPU (every command printed, the
CPU-checkable steps run at tiny sizes, their files written), its time budget, its usage errors, and the parity
step failing loudly when a backend is off."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo_kernels as gk
from benchmarks import gpu_parity, gpu_run, host_overhead

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")


def run_gpu(*args: str, bench_k: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WHEELS", "GPU_RUN_BENCH_K", "TRITON_INTERPRET")}
    env["PYTHON"] = sys.executable
    if bench_k:
        env["GPU_RUN_BENCH_K"] = bench_k
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def steps(outdir: Path) -> dict[str, str]:
    return {line.split("\t")[0]: line.split("\t")[1] for line in (outdir / "steps.tsv").read_text().splitlines()}


def test_dry_run(tmp_path):
    """Every GPU command is printed; the CPU-checkable steps run and write their files. (The suites run only the
    torch-backend cases here, through GPU_RUN_BENCH_K, to keep the test short; mismatch, divergence and one_pass,
    which it does not narrow, run every case at their smoke size.)"""
    out = run_gpu("--dry-run", str(tmp_path), bench_k="torch")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for command in (
        "GRPO_KERNELS_BUILD_CUDA=1",
        "setup.py build_ext --inplace",
        "-m pytest -m cuda",
        "-m benchmarks.gpu_parity --out",
        "-m benchmarks.headline --out",
        "-m benchmarks.headline --size smoke --iters 1",
        "-m benchmarks.host_overhead --device cuda --backend triton",
        "-m benchmarks.compiled_step --out",
        "-m benchmarks.compiled_step --size smoke",
        "benchmarks/bench_grpo_loss.py",
        "benchmarks/bench_fused_linear.py",
        "benchmarks/bench_token_logprobs.py",
        "--bench-size gpu --benchmark-json",
        "-m benchmarks.interleaved --out",
        "-m benchmarks.lean_memory --device cuda",
        "-m benchmarks.packing_step --size gpu",
        "-m benchmarks.sampling_replay --size gpu",
        *(
            f"{files} -rs -q -p no:cacheprovider -p benchmarks.gpu_run --bench-size gpu "
            f"--benchmark-json {tmp_path}/bench/{step}.json"
            for step, files in (
                ("mismatch", "benchmarks/bench_mismatch.py"),
                ("divergence", "benchmarks/bench_divergence.py benchmarks/bench_teacher_term.py"),
                ("one_pass", "benchmarks/bench_one_pass.py"),
            )
        ),
        "-m benchmarks.vllm_sampling_mask",
        "-m benchmarks.vllm_train",
        "-m benchmarks.gpu_run report",
        "--bench-size smoke --benchmark-disable",
    ):
        assert command in out.stdout, command
    status = steps(tmp_path)
    assert status == dict(
        env="ok",
        build="dry run: printed",
        tests="dry run: printed",
        parity="ok",
        headline="ok",
        host="ok",
        compiled="ok",
        bench_grpo_loss="ok",
        bench_fused_linear="ok",
        bench_token_logprobs="ok",
        interleaved="ok",
        lean_memory="ok",
        packing="ok",
        replay="ok",
        mismatch="ok",
        divergence="ok",
        one_pass="ok",
        vllm_mask="dry run: printed",  # the GPU run does it when vllm is importable
        vllm_train="dry run: printed",  # the GPU run does it when vllm is importable
        report="ok",
    )
    assert json.loads((tmp_path / "env.json").read_text())["torch"] == torch.__version__
    parity = json.loads((tmp_path / "parity" / "parity.json").read_text())
    assert parity["failures"] == 0 and parity["size"] == "smoke"
    assert {r["backend"] for r in parity["records"]} == {"torch"}
    assert {(r["op"], r["dtype"]) for r in parity["records"]} == {
        (op, dtype) for op in gpu_parity.CASES for dtype in gpu_parity.DTYPES
    }
    headline = json.loads((tmp_path / "headline" / "headline.json").read_text())
    assert headline["size"] == "smoke" and set(headline["cases"]) == {"32", "64"}
    peers = {"trl"} if importlib.util.find_spec("trl") else set()  # TRL's head, where the trl extra is installed
    assert {"gemms", "ours", *peers} <= {p for p, r in headline["cases"]["32"].items() if "median_ms" in r}
    interleaved = json.loads((tmp_path / "bench" / "interleaved-trl.json").read_text())
    assert {b["extra_info"]["provider"] for b in interleaved["benchmarks"]} >= {"torch"}
    compiled = json.loads((tmp_path / "compiled" / "compiled_step.json").read_text())
    assert compiled["size"] == "smoke" and set(compiled["cases"]) == {"token_logprobs_fwd", "grpo_loss_fwd_bwd"}
    assert all("wall_ms" in case[mode] for case in compiled["cases"].values() for mode in ("eager", "compiled"))
    summary = (tmp_path / "SUMMARY.md").read_text()
    host = json.loads((tmp_path / "host" / "host.json").read_text())
    assert {r["function"] for r in host["rows"]} == set(host_overhead.FUNCTIONS)
    sections = ("## Machine", "## Steps", "## Parity (float64 oracle)", "## Host time", "## The public API compiled")
    for section in (*sections, "## Benchmarks against"):
        assert section in summary
    assert (tmp_path / "bench" / "benchmarks.md").exists() and (tmp_path / "logs" / "parity.log").exists()


PLAN_BOUNDS = {"first": 480, "second": 240}
PLAN_STEPS = {
    "first": ["env", "build", "tests", "parity", "headline", "host", "compiled", "report"],
    "second": ["env", "bench_grpo_loss", "bench_fused_linear", "bench_token_logprobs", "lean_memory", "packing"]
    + ["replay", "report"],
}


def _plans(stdout: str) -> dict[str, tuple[dict[str, int], int]]:
    """The plans the dry run printed: name -> ({step: timeout}, sum)."""
    plans = {}
    for line in stdout.splitlines():
        match = re.fullmatch(r"plan (\w+): (.*), sum (\d+) s", line)
        if match:
            steps = dict((step, int(t)) for step, t in re.findall(r"(\w+) (\d+) s", match.group(2)))
            plans[match.group(1)] = (steps, int(match.group(3)))
    return plans


def test_plans_fit_their_bounds(tmp_path):
    """--dry-run prints both plans, each step with its timeout and their sum: the first fits one 8-minute call, the
    second 4 minutes; a plan's steps run with its timeouts, and its budget is their sum."""
    out = run_gpu("--dry-run", "--plan", "first", "--only", "build,tests", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    plans = _plans(out.stdout)
    assert set(plans) == set(PLAN_BOUNDS)
    for name, (timeouts, total) in plans.items():
        assert list(timeouts) == PLAN_STEPS[name]
        assert sum(timeouts.values()) == total <= PLAN_BOUNDS[name], (name, timeouts)
    assert "budget 480 s (plan first)" in out.stdout
    first = plans["first"][0]
    assert re.search(rf"setup.py build_ext --inplace +# timeout {first['build']} s\n", out.stdout)
    assert re.search(rf"-m pytest -m cuda .* +# timeout {first['tests']} s\n", out.stdout)
    assert list(steps(tmp_path)) == ["build", "tests"]


def test_out_of_time_steps_are_skipped_and_named(tmp_path):
    """60 s stay reserved for the report: with 20 s, the steps before it are skipped and listed, the report runs."""
    out = run_gpu("--dry-run", "--budget", "20", "--only", "env,parity,report", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps(tmp_path) == dict(env="skipped (out of time)", parity="skipped (out of time)", report="ok")
    assert "skipped for lack of time: env parity (run them in another call: --only env,parity)" in out.stdout
    skipped = (tmp_path / "skipped.txt").read_text()
    assert "env: skipped, out of time" in skipped and "benchmarks.gpu_parity" in skipped
    assert "Skipped for lack of time" in (tmp_path / "SUMMARY.md").read_text()


@pytest.mark.parametrize(
    "args,message",
    [
        (("--only", "parity,nonsense"), "unknown step nonsense"),
        (("--frobnicate",), "unknown option --frobnicate"),
        (("--budget", "ten"), "--budget takes whole seconds"),
        (("--dry-run",), "OUTDIR is missing"),
        (("--plan", "third"), "--plan takes first or second, got third"),
    ],
)
def test_usage_errors(tmp_path, args, message):
    out = run_gpu(*args, *([] if "OUTDIR" in message else [str(tmp_path)]))
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_refuses(tmp_path):
    out = run_gpu("--only", "env", str(tmp_path))
    assert out.returncode == 2 and "use --dry-run" in out.stderr


def test_parity_fails_loudly(tmp_path, monkeypatch, capsys):
    """A backend whose loss is off by 1e-4 (relative) fails fp32's 1e-5 tolerance: exit 1, a PARITY FAILED line,
    the failure in parity.json and parity.md."""
    grpo_loss = gk.grpo_loss

    def off(*args, **kwargs):
        out = grpo_loss(*args, **kwargs)
        return out._replace(loss=out.loss + 1e-4 * out.loss.detach())  # the value off, not the gradient

    monkeypatch.setattr(gk, "grpo_loss", off)
    args = ["--size", "smoke", "--backends", "torch", "--dtypes", "fp32", "--ops", "grpo_loss", "--out", str(tmp_path)]
    assert gpu_parity.main(args) == 1
    assert "PARITY FAILED: grpo_loss[dapo] fp32 loss torch: max error" in capsys.readouterr().err
    parity = json.loads((tmp_path / "parity.json").read_text())
    failed = {(r["loss"], r["quantity"]) for r in parity["records"] if not r["ok"]}
    assert failed == {(loss, "loss") for loss in gpu_parity.CASES["grpo_loss"]}
    assert "**FAIL**" in (tmp_path / "parity.md").read_text()


def test_an_interrupted_suite_keeps_its_finished_cases():
    """The plugin run_gpu.sh loads into the suites drops the case an interrupt left without rounds (pytest-benchmark
    would fail on it and save no JSON at all), and keeps the finished ones."""
    finished, interrupted = ["a round"], []  # pytest-benchmark's cases are truthy when they hold data
    session = SimpleNamespace(
        config=SimpleNamespace(_benchmarksession=SimpleNamespace(benchmarks=[finished, interrupted]))
    )
    hook = gpu_run.pytest_sessionfinish(session, exitstatus=2)
    next(hook)
    assert session.config._benchmarksession.benchmarks == [finished]


def test_parity_tolerance_is_rtol_or_twice_the_plain_error():
    """gpu_parity passes a quantity within max(RTOL[dtype], 2 × the plain implementation's error), scale-relative."""

    def tally(err: float, scale: float = 2.0):
        t = gpu_parity.Tally()
        t.err, t.scale = err, scale
        return t

    ours = tally(6e-5)  # 3e-5 of the scale
    for plain, tol, ok in ((tally(4e-5), 4e-5, True), (tally(2e-5), 2e-5, False), (None, 1e-5, False)):
        r = ours.result(torch.float32, plain)
        assert (r["rel"], r["tol"], r["ok"]) == (pytest.approx(3e-5), pytest.approx(tol), ok)
    assert ours.result(torch.float32, tally(float("nan")))["tol"] == 1e-5  # a non-finite plain error is no excuse
    assert tally(1e-6).result(torch.float32, tally(1e-9))["tol"] == 1e-5  # RTOL is the floor

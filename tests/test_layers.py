"""The engine's layering: the kernels know nothing of the engine or the losses (they receive plain data), and every
backend is one capability record whose modules follow the backend protocol."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from grpo_kernels.kernels import protocol
from grpo_kernels.kernels.backend import CAPABILITIES

KERNELS = Path(__file__).resolve().parent.parent / "grpo_kernels" / "kernels"
FORBIDDEN = ("grpo_kernels.engine", "grpo_kernels.losses", "grpo_kernels.checks", "grpo_kernels.options")


def _imports(path: Path) -> list[str]:
    """Every module a file imports (at any depth: function-level imports too), as dotted names."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", sorted(KERNELS.rglob("*.py")), ids=lambda p: p.name)
def test_kernels_import_no_engine_losses_checks_or_options(path):
    bad = [name for name in _imports(path) if name.startswith(FORBIDDEN) or name == "grpo_kernels.checks"]
    assert not bad, f"{path.name} imports {bad}"


def test_the_import_rule_sees_a_forbidden_import(tmp_path):
    """The rule above can fail: a kernel file importing the options is caught, at module or function level."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from grpo_kernels.options import LossOptions\n")
    assert any(name.startswith(FORBIDDEN) for name in _imports(source))


@pytest.mark.parametrize("name", sorted(CAPABILITIES))
def test_each_backend_module_follows_the_protocol(name):
    """The module of a capability record (imported without running a kernel) has the functions the record says."""
    caps = CAPABILITIES[name]
    if name == "triton":
        pytest.importorskip("triton")
    parts = {"module": protocol.VOCAB_PASS, "epilogue_module": protocol.EPILOGUE, "tile_module": protocol.TILES}
    for part, functions in parts.items():
        module_name = getattr(caps, part)
        if module_name is None:
            continue
        module = importlib.import_module(module_name)
        missing = [f for f in functions if not callable(getattr(module, f, None))]
        assert not missing, f"{module_name} lacks {missing}"
    assert (caps.epilogue_module is None) == (caps.epilogue_kl == ())
    kinds = getattr(importlib.import_module(caps.epilogue_module), "KL_KINDS", None) if caps.epilogue_module else None
    if kinds is not None:  # the record lists exactly the estimators the kernel maps
        assert set(caps.epilogue_kl) == set(kinds)


@pytest.mark.parametrize(
    "name", ["grpo_loss", "fused_linear_grpo_loss", "token_logprobs", "fused_linear_token_logprobs"]
)
def test_every_public_argument_reaches_the_plan(name):
    """The public functions hand their arguments to the plan by name (`NamedRecord.named(locals())`): each one is a
    field of `LossTensors` or `Request`, or one the function passes itself."""
    import dataclasses
    import inspect

    import grpo_kernels as gk
    from grpo_kernels.engine.inputs import LossTensors
    from grpo_kernels.engine.plan import Request

    fields = {f.name for record in (LossTensors, Request) for f in dataclasses.fields(record)}
    passed = {"logits", "hidden", "weight", "bias", "targets", "mask", "options", "loss_options"}
    parameters = set(inspect.signature(getattr(gk, name)).parameters)
    assert parameters <= fields | passed, parameters - fields - passed

"""The engine's layering: the kernels know nothing of the engine or the losses (they receive plain data) and decide no
policy, every backend is one capability record whose modules follow the backend protocol, only the engine sees its
layout, the engine stands on its own checks (not the building blocks'), and no import circle runs through engine/,
kernels/ or trainer/."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from grpo_kernels.kernels import protocol
from grpo_kernels.kernels.backend import CAPABILITIES

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_kernels"
KERNELS = PACKAGE / "kernels"
ENGINE = PACKAGE / "engine"
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


@pytest.mark.parametrize("path", sorted(KERNELS.rglob("*.py")), ids=lambda p: p.relative_to(KERNELS).as_posix())
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
    """The public functions hand their arguments to the plan by name (their `locals()`): each one is a
    field of `LossTensors` or `Request`, or one the function passes itself."""
    import dataclasses
    import inspect

    import grpo_kernels as gk
    from grpo_kernels.engine.inputs import LossTensors
    from grpo_kernels.engine.plan import Request

    fields = {f.name for record in (LossTensors, Request) for f in dataclasses.fields(record)}
    passed = {"logits", "hidden", "weight", "bias", "targets", "mask", "options", "loss_options"}
    passed |= {"teacher_hidden", "teacher_weight", "teacher_bias"}  # to the teacher term (`teacher_term.py`)
    parameters = set(inspect.signature(getattr(gk, name)).parameters)
    assert parameters <= fields | passed, parameters - fields - passed


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth (function-level and `TYPE_CHECKING` imports too);
    `from X import Y` names the module X.Y where Y is one, else X."""
    files = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        found = set()
        for imported in _imports(path):
            if imported in files:
                found.add(imported)
        found = {m for m in found if not any(other.startswith(m + ".") for other in found)}  # X.Y, not X too
        graph[name] = found - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


@pytest.mark.parametrize("area", ["grpo_kernels.engine", "grpo_kernels.kernels", "grpo_kernels.trainer"])
def test_no_import_circle(area):
    """No circle of imports (function-level and TYPE_CHECKING ones counted) touches engine/, kernels/ or trainer/."""
    touching = [group for group in circles(import_graph()) if any(m.startswith(area + ".") for m in group)]
    assert not touching, f"import circles through {area}: {touching}"


def test_the_circle_rule_sees_a_circle(tmp_path):
    """The graph counts a function-level and a TYPE_CHECKING import, and the circle search finds their circle."""
    package = tmp_path / "grpo_kernels"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from grpo_kernels import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo_kernels.a import f\n"
    )
    assert circles(import_graph(package)) == [["grpo_kernels.a", "grpo_kernels.b"]]


def test_only_the_engine_imports_its_layout():
    outside = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if ENGINE not in path.parents and any(n.startswith("grpo_kernels.engine.layout") for n in _imports(path))
    ]
    assert not outside, f"engine.layout imported outside engine/: {outside}"


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")), ids=lambda p: p.name)
def test_the_engine_does_not_import_the_building_blocks_checks(path):
    assert "grpo_kernels.checks" not in _imports(path), f"{path.name} imports grpo_kernels.checks"


def test_kernels_decide_no_memory_or_route_policy():
    """The memory and route functions live in engine/: no kernel module defines them."""
    from grpo_kernels.engine import memory, plan

    policy = ("resolve_memory", "chunk_rows", "available_bytes", "lean_backends", "choose_route")
    for path in KERNELS.rglob("*.py"):
        defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
        assert not defined & set(policy), f"{path.relative_to(KERNELS)} defines {defined & set(policy)}"
    assert all(callable(getattr(memory, f, None)) for f in policy[:-1]) and callable(plan.choose_route)


def test_the_kl_list_is_declared_once():
    """Every backend record with an epilogue lists the protocol's estimators (`protocol.EPILOGUE_KL`)."""
    for caps in CAPABILITIES.values():
        assert caps.epilogue_kl in ((), protocol.EPILOGUE_KL), caps.name
    literal = '"k1", "k2", "k3", "low_var_kl"'
    holders = [p.relative_to(KERNELS).as_posix() for p in KERNELS.rglob("*.py") if literal in p.read_text()]
    assert holders == ["protocol.py"], holders


def test_each_backend_is_a_subpackage_with_its_record():
    for name, caps in CAPABILITIES.items():
        package = importlib.import_module(f"grpo_kernels.kernels.{name}")
        assert package.RECORD is caps
        assert caps.module.startswith(f"grpo_kernels.kernels.{name}.")


def test_the_trainer_imports_the_config_modules_not_their_package():
    """`trainer/config/__init__.py` re-exports its modules for users; inside trainer/ (the command aside) modules
    import the module that holds a name, so importing the package's re-exports never runs back into them."""
    trainer = PACKAGE / "trainer"
    importers = [
        path.relative_to(trainer).as_posix()
        for path in trainer.rglob("*.py")
        if path.name != "__main__.py" and "grpo_kernels.trainer.config" in _imports(path)
    ]
    assert not importers, f"import grpo_kernels.trainer.config (the package) instead of its modules: {importers}"

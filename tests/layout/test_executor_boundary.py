"""The executor is the engine layer's only door to the devices: nothing under engine/engine imports
from xlaserve.worker (the model runner, its loaders and caches), and the engine core reaches the
runner through no attribute of its executor either. Read from the source with `ast`, function-local
imports included, so a lazy import cannot hide a crossing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_LAYER = ROOT / "engine" / "engine"
WORKER = "xlaserve.worker"


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_engine_layer_imports_nothing_from_the_worker():
    files = sorted(ENGINE_LAYER.rglob("*.py"))
    assert any(p.name == "core.py" for p in files)  # not vacuous: the engine core is among them
    crossing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in _imported_modules(ast.parse(path.read_text()))
        if name == WORKER or name.startswith(WORKER + ".")
    ]
    message = "engine/engine imports the worker layer (ask the executor):\n"
    assert crossing == [], message + "\n".join(crossing)


def test_engine_core_calls_no_runner():
    """EngineCore's own code never goes through `executor.runner` (its `runner` property, kept for tests
    and benchmarks that inspect the runner, is the one read of it)."""
    tree = ast.parse((ENGINE_LAYER / "core.py").read_text())
    reads = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "runner"
        and not (isinstance(node.value, ast.Attribute) and node.value.attr == "executor")
    ]
    via_executor = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "runner"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "executor"
    ]
    assert reads == [], f"engine/engine/core.py reads a runner at lines {reads}"
    assert len(via_executor) == 1, f"engine/engine/core.py reads executor.runner at lines {via_executor}"

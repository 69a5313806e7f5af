"""The server's front end spawns the engine core before it imports jax or transformers, so that
those imports (~1 s) overlap the core's start (api_server._serve): AsyncLLM itself must not pull
them in. And the front end loads no model: reading a checkpoint belongs to the executor, so no
module of the engine layer imports a loader (read from the source, lazy imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_async_llm_imports_neither_jax_nor_transformers():
    code = (
        "import sys\n"
        "import xlaserve.engine.async_llm\n"
        "print(sorted(m for m in ('jax', 'transformers', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# What reads a model: its weights (the loaders) or its classes (the registry). The engine layer asks
# its executor for a model instead (xlaserve.executor.load_model, worker/loading.py).
MODEL_LOADERS = (
    "xlaserve.models.loader",
    "xlaserve.models.safetensors_loader",
    "xlaserve.models.gguf_loader",
    "xlaserve.models.orbax_checkpoint",
    "xlaserve.models.weights",
    "xlaserve.models.registry",
)
# The front end's tokenizer (text in and out, no weights) is the one name it may take from the loader.
ALLOWED = {("xlaserve.models.loader", "load_tokenizer")}
ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine" / "engine"


def loader_imports(path: Path) -> list[str]:
    """Every import of a model loader in `path`, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(MODEL_LOADERS)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if (node.module, a.name) in ALLOWED:
                    continue
                if node.module.startswith(MODEL_LOADERS) or full.startswith(MODEL_LOADERS):
                    found.append(full)
    return found


def test_engine_layer_imports_no_model_loader():
    files = sorted(ENGINE_DIR.rglob("*.py"))
    assert len(files) > 10  # the folder is where this test thinks it is
    found = {str(p.relative_to(ENGINE_DIR)): loader_imports(p) for p in files}
    assert {f: names for f, names in found.items() if names} == {}


def test_engine_layer_imports_jax_only_through_the_executor():
    """No module of engine/engine/ imports jax itself (the executor and the worker own the devices)."""
    found = {}
    for path in sorted(ENGINE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "jax" or n.startswith("jax.") for n in names):
                found.setdefault(str(path.relative_to(ENGINE_DIR)), []).extend(names)
    assert found == {}


def test_async_llm_loads_no_model_code():
    code = (
        "import sys\n"
        "import xlaserve.engine.async_llm, xlaserve.engine.core_client\n"
        f"print(sorted(m for m in {MODEL_LOADERS!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

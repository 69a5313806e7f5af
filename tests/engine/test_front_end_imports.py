"""The server's front end spawns the engine core before it imports jax or transformers, so that
those imports (~1 s) overlap the core's start (api_server._serve): AsyncLLM itself must not pull
them in. And the front end loads no model: reading a checkpoint belongs to the executor, so the
engine layer imports nothing of models/ but its tokenizer, which imports neither a loader nor jax
(read from the source, lazy imports included)."""

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


# The commands' own modules: the CLI module imports them only to build its parser (app and the
# server's state: once `serve` runs).
COMMANDS = ("api_server", "router", "run_batch", "bench", "app", "serving.state")
COMMAND_MODULES = tuple(f"xlaserve.entrypoints.{name}" for name in COMMANDS)


def test_the_server_front_end_imports_no_jax_and_its_cli_no_other_command():
    """What `xlaserve serve`'s front end imports to serve (api_server._serve's imports) holds no jax, flax
    or torch (a LoRA adapter's host-side checks once brought in jax, ~1 s a start). And the CLI module
    alone imports no command's module: the engine core process imports it again (multiprocessing's spawn
    runs the parent's main module) before it reads its config."""
    code = (
        "import sys\n"
        "import xlaserve.entrypoints.cli\n"
        f"print(sorted(m for m in sys.modules if m.startswith({COMMAND_MODULES!r})))\n"
        "import xlaserve.entrypoints.api_server, xlaserve.engine.async_llm, xlaserve.entrypoints.app\n"
        "import xlaserve.entrypoints.serving.guard, xlaserve.entrypoints.serving.http11\n"
        "import xlaserve.entrypoints.serving.state, uvicorn\n"
        "print(sorted(m for m in ('jax', 'flax', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cli_imports, heavy = out.stdout.splitlines()
    assert cli_imports == "[]"
    assert heavy == "[]"


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
# The modules of models/ the front end imports: its tokenizer (text in and out, no weights) and what a
# vision-language model's processor settings say (image sizes, a video's frame rate).
FRONT_END_MODELS = ("xlaserve.models.tokenizer", "xlaserve.models.processor_settings")
HEAVY = ("jax", "jaxlib", "flax", "orbax", "torch")  # what the front end's tokenizer must not import
ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / "engine" / "engine"
PACKAGE_DIRS = {"xlaserve.models": "models", "xlaserve.kernels": "kernels", "xlaserve.sharding": "sharding",
                "xlaserve": "engine"}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, function-local imports included (`from a import b`: a, and a.b
    for when b is a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: a relative import"  # absolute imports throughout
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def source_of(module: str) -> Path | None:
    """The file of an xlaserve module, None for anything else (a name imported from a module)."""
    for package, folder in PACKAGE_DIRS.items():
        if module == package or module.startswith(package + "."):
            base = ROOT / folder / Path(*module[len(package) + 1 :].split("."))
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
            return None
    return None


def test_engine_layer_imports_no_model_loader():
    """Of models/, the engine layer imports its tokenizer only."""
    files = sorted(ENGINE_DIR.rglob("*.py"))
    assert len(files) > 10  # the folder is where this test thinks it is
    found = {}
    for path in files:
        names = sorted(
            m
            for m in imported_modules(path)
            if m.startswith("xlaserve.models") and source_of(m) is not None and m not in FRONT_END_MODELS
        )
        if names:
            found[str(path.relative_to(ENGINE_DIR))] = names
    assert found == {}
    assert any("xlaserve.models.tokenizer" in imported_modules(p) for p in files)  # not vacuous


def test_front_end_tokenizer_imports_no_jax_and_no_loader():
    """What the front end imports of models/ pulls in, transitively within xlaserve (lazy imports
    included), neither jax nor flax, orbax or torch, nor a model loader."""
    seen, todo, outside = set(), list(FRONT_END_MODELS), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in imported_modules(source_of(module)):
            if source_of(name) is not None:
                todo.append(name)
            elif not name.startswith("xlaserve"):
                outside.add(name.split(".")[0])
    assert "xlaserve.models.gguf_reader" in seen  # the walk follows imports (GGUF metadata)
    assert sorted(outside & set(HEAVY)) == []
    assert sorted(m for m in seen if m.startswith(MODEL_LOADERS)) == []


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
    """Nor does the tokenizer module, imported (third-party packages included)."""
    code = (
        "import sys\n"
        "import xlaserve.engine.async_llm, xlaserve.engine.core_client, xlaserve.models.tokenizer\n"
        f"print(sorted(m for m in {MODEL_LOADERS + HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

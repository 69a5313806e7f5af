"""The shape of the package: imports run one way between the layers, with no cycles, and the
scheduling layer loads no jax. Read from the source (every import, function-local ones included),
so a lazy import cannot hide an upward edge or a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The repository's folders and the package each installs as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"engine": "xlaserve", "models": "xlaserve.models", "kernels": "xlaserve.kernels",
                "sharding": "xlaserve.sharding"}  # fmt: skip
# Top to bottom: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    "xlaserve.entrypoints",
    "xlaserve.engine",
    "xlaserve.executor",
    "xlaserve.worker",
    "xlaserve.core",
    "xlaserve.models",
    "xlaserve.sharding",
    "xlaserve.kernels",
]
# Plain data every layer shares (configs, sampling parameters, user-facing outputs): they import
# no layer at all.
BASE = {"xlaserve.config", "xlaserve.config_args", "xlaserve.speculative_config", "xlaserve.sampling_params",
        "xlaserve.outputs", "xlaserve.lora_request", "xlaserve.pooling_params",
        "xlaserve.structured_outputs_params"}  # fmt: skip


def is_base(module: str) -> bool:
    """Shared data: a BASE module, or a module of the config package (xlaserve.config.*)."""
    return module in BASE or module.startswith("xlaserve.config.")


def module_files() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The xlaserve modules `path` imports (a name imported from a package counts as the
    submodule when there is one)."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def layer_of(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return index
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: imports_of(p, m, modules) - {m} for m, p in modules.items()}


def test_every_module_belongs_to_a_layer(graph):
    loose = [m for m in graph if layer_of(m) is None and not is_base(m) and m != "xlaserve"]
    assert loose == [], f"modules outside the layers (add them to a layer's folder): {loose}"


def test_imports_run_downwards(graph):
    upward = []
    for module, imported in graph.items():
        if module == "xlaserve":  # the package's public API re-exports from the top
            continue
        for target in imported:
            if is_base(module):
                if not is_base(target):
                    upward.append(f"{module} -> {target} (shared data imports no layer)")
            elif not is_base(target) and target != "xlaserve" and layer_of(target) < layer_of(module):
                upward.append(f"{module} -> {target}")
            elif target == "xlaserve":
                upward.append(f"{module} -> xlaserve (import the defining module instead)")
    assert upward == [], "imports that run upwards:\n" + "\n".join(sorted(upward))


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components over every import, lazy ones included."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            # A package's __init__ re-exporting its own submodules is not a cycle of design.
            if len(component) > 1 and not all(m.startswith(min(component, key=len)) for m in component):
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == [], f"import cycles: {cycles}"


# The HTTP server's API packages, and the code they share: each API imports only the shared code,
# which imports neither; the server's app (xlaserve.entrypoints.app) is the one place that knows both.
API_PACKAGES = ("xlaserve.entrypoints.openai", "xlaserve.entrypoints.anthropic")
SHARED_SERVING = "xlaserve.entrypoints.serving"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_api_packages_import_only_the_shared_serving_code(graph):
    crossing = []
    for module, imported in graph.items():
        own = next((p for p in API_PACKAGES if _in(module, p)), None)
        if own is None and not _in(module, SHARED_SERVING):
            continue  # the app, the CLI: above both
        for target in imported:
            if any(_in(target, p) for p in API_PACKAGES if p != own):
                crossing.append(f"{module} -> {target}")
    assert crossing == [], (
        "imports between the API packages, or from the shared code into one:\n" + "\n".join(sorted(crossing))
    )
    # Not vacuous: both APIs build on the shared code, and the app mounts both.
    for package in API_PACKAGES:
        assert any(_in(t, SHARED_SERVING) for m, ts in graph.items() if _in(m, package) for t in ts)
        assert any(_in(t, package) for t in graph["xlaserve.entrypoints.app"])


def test_the_graph_sees_lazy_imports(graph):
    """The checks above would pass vacuously if function-local imports were missed."""
    assert "xlaserve.entrypoints.llm" in graph["xlaserve"]  # imported inside xlaserve.__getattr__
    assert "xlaserve.engine.startup" in graph["xlaserve.engine.core_proc"]  # inside the core process


def test_scheduling_layer_and_public_api_load_no_jax():
    code = (
        "import sys\n"
        "import xlaserve.core.scheduler, xlaserve.core.kv_cache_manager, xlaserve.core.block_pool\n"
        "from xlaserve import SamplingParams, RequestOutput\n"
        "heavy = sorted(m for m in ('jax', 'flax', 'torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == ""

"""A regular (non-editable) install puts one package, `xlaserve`, into a fresh virtual
environment, and nothing generic beside it."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def runtime_distributions() -> list[importlib.metadata.Distribution]:
    """The installed distributions a plain `pip install .` brings: pyproject's dependencies, and
    theirs, without extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo, seen, found = list(project["dependencies"]), set(), []
    while todo:
        requirement = Requirement(todo.pop())
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        found.append(dist)
        todo += dist.requires or []
    return found


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The dependencies come from the test environment, only those a plain install has (pyproject's
    # dependencies and theirs: no torch, no test extra's, no editable xlaserve); xlaserve itself from a
    # real build. Before stop 73 every test package was there, and a plain install's `xlaserve` failed on
    # an import of the test extra's httpx unseen.
    deps = venv.parent / "deps"
    deps.mkdir()
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in sorted({file.parts[0] for dist in runtime_distributions() for file in dist.files or ()}):
        if (purelib / entry).exists() and not entry.startswith(".."):
            (deps / entry).symlink_to(purelib / entry)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "test_dependencies.pth").write_text(f"{deps}\n")
    # Built from a copy: setuptools writes build/ and *.egg-info/ beside the sources it builds.
    source = venv.parent / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__")
    )
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)], check=True, capture_output=True
    )
    return venv


@pytest.mark.slow
def test_regular_install_is_one_namespace(fresh_venv):
    python = fresh_venv / "bin" / "python"
    code = (
        "import importlib, xlaserve, xlaserve.models, xlaserve.kernels, xlaserve.sharding\n"
        "import xlaserve.entrypoints.cli\n"
        "print(xlaserve.__file__)\n"
        "for name in ('engine', 'models', 'kernels', 'sharding'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print('importable', name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd="/", check=True)
    lines = out.stdout.split()
    assert lines[0].startswith(str(fresh_venv)), lines[0]  # the installed copy, not the checkout
    assert lines[1:] == []  # no generic top-level package shadows a user's own `models/`
    site = Path(lines[0]).parent.parent
    top = sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth")))
    ours = [name for name in top if name in ("xlaserve", "engine", "models", "kernels", "sharding")]
    assert ours == ["xlaserve"]
    assert (site / "xlaserve" / "models" / "llama.py").is_file()  # subfolders come along
    # The CPU ops' C++ sources come along: an installed package builds them on first use.
    cpu = site / "xlaserve" / "kernels" / "cpu"
    assert {p.name for p in cpu.iterdir()} >= {"paged_attention.cc", "quantized_matmul.cc", "parallel.h"}


@pytest.mark.slow
def test_console_script_starts_without_heavy_imports(fresh_venv):
    """`xlaserve --help` answers, and the CLI module pulls in neither jax nor transformers."""
    script = fresh_venv / "bin" / "xlaserve"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd="/", check=True)
    assert "generate" in out.stdout and "serve" in out.stdout and out.stderr == ""
    code = (
        "import sys, xlaserve.entrypoints.cli\n"
        "print(sorted(m for m in ('jax', 'flax', 'torch', 'transformers', 'fastapi') if m in sys.modules))\n"
    )
    python = fresh_venv / "bin" / "python"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_commands_start_without_stray_library_lines(fresh_venv):
    """Without torch, transformers prints "PyTorch was not found..." when it is imported; every
    command that loads a tokenizer imports it, after the CLI has quieted the libraries."""
    python = fresh_venv / "bin" / "python"
    code = (
        "from xlaserve.entrypoints.cli import quiet_libraries\n"
        "quiet_libraries()\n"
        "import transformers, importlib.util\n"
        "assert importlib.util.find_spec('torch') is None\n"
    )
    # The environment without the switch (an earlier test's CLI run may have set it in this process).
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    out = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, cwd="/", check=True, env=env
    )
    assert out.stdout + out.stderr == ""
    loud = subprocess.run(
        [str(python), "-c", "import transformers"], capture_output=True, text=True, cwd="/", env=env
    )
    assert "PyTorch was not found" in loud.stderr  # the line the CLI keeps from its users

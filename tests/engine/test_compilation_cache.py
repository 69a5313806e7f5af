"""The persistent compilation cache: on by default under ~/.cache/xlaserve (XLASERVE_CACHE_ROOT
moves it), off on request, and a second start loads every warm-up program instead of compiling it
while the compile guard still counts them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.tiny_models import save_tiny_llama
from xlaserve.config import EngineConfig

WARM_UP = re.compile(
    r"warm-up: (\d+) programs .* \((\d+) from the persistent cache; XLA compile time ([\d.]+)s\)"
)


def test_default_location_and_switches(monkeypatch, tmp_path):
    monkeypatch.delenv("XLASERVE_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("XLASERVE_DISABLE_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("XLASERVE_CACHE_ROOT", raising=False)
    home = os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "xla")
    assert EngineConfig.from_kwargs(None).compilation.compilation_cache_dir == home
    monkeypatch.setenv("XLASERVE_CACHE_ROOT", str(tmp_path))
    compilation = EngineConfig.from_kwargs(None).compilation
    assert (
        compilation.compilation_cache_dir == str(tmp_path / "xla")
        and not compilation.disable_compilation_cache
    )
    monkeypatch.setenv("XLASERVE_DISABLE_COMPILATION_CACHE", "1")
    assert EngineConfig.from_kwargs(None).compilation.disable_compilation_cache
    with pytest.raises(ValueError, match="compilation_cache_max_size must be > 0"):
        EngineConfig.from_kwargs(None, compilation_cache_max_size=0)


def _warm_start(model: str, cache_root: str) -> tuple[int, int, float]:
    """`xlaserve generate` in a fresh process -> (programs at warm-up, from the cache, compile s)."""
    command = [sys.executable, "-m", "xlaserve.entrypoints.cli", "generate", "Hi", "--model", model,
               "--raw", "--max-tokens", "2", "--max-model-len", "64", "--max-num-batched-tokens", "16",
               "--max-num-seqs", "4", "--kv-cache-memory", str(2**22), "--dtype", "float32"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLASERVE_")}
    env["XLASERVE_CACHE_ROOT"] = cache_root
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    match = WARM_UP.search(result.stderr)
    assert match, result.stderr[-3000:]
    return int(match[1]), int(match[2]), float(match[3])


def test_disabled_cache_leaves_jax_alone(tmp_path):
    import jax

    from xlaserve.config import CompilationConfig
    from xlaserve.engine.startup import setup_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    setup_compilation_cache(
        CompilationConfig(compilation_cache_dir=str(tmp_path / "never"), disable_compilation_cache=True)
    )
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "never").exists()


@pytest.mark.slow  # two engine starts of a tiny model
def test_second_start_loads_every_program_from_the_cache(tmp_path):
    model = save_tiny_llama(str(tmp_path / "model"))
    root = str(tmp_path / "cache")
    programs, hits, cold_s = _warm_start(model, root)
    assert programs > 0 and hits == 0
    assert os.listdir(os.path.join(root, "xla"))
    again, hits, warm_s = _warm_start(model, root)
    assert again == programs and hits == programs  # the compile guard sees them all the same
    assert warm_s < cold_s / 2, (warm_s, cold_s)

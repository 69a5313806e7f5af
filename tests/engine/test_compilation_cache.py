"""The persistent compilation cache: on by default under ~/.cache/xlaserve (XLASERVE_CACHE_ROOT
moves it), off on request, and a second start loads every warm-up program instead of compiling it
(its serialized executables, worker/program_store.py)."""

from __future__ import annotations

import json
import os

import pytest

from helpers.tiny_models import TINY_PROCESS_XLA_FLAGS, save_tiny_llama, small_byte_tokenizer
from xlaserve.config import EngineConfig
from xlaserve.entrypoints.bench.startup import engine_flags_only


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


@pytest.mark.slow  # three engine starts of a tiny model
def test_bench_startup_second_start_loads_every_program_from_the_cache(tmp_path, monkeypatch):
    """`xlaserve bench startup`: a cold then a warm `xlaserve generate`, each in a fresh process."""
    from xlaserve.entrypoints import cli

    monkeypatch.setenv("XLA_FLAGS", TINY_PROCESS_XLA_FLAGS)  # the starts' processes: a tiny model

    # A 320-token vocabulary: SmolLM2's 49,152 made every sampler program ~150x wider to compile.
    model = save_tiny_llama(str(tmp_path / "model"), tokenizer=small_byte_tokenizer())
    engine = ["--max-model-len", "64", "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
              "--kv-cache-memory", str(2**22), "--dtype", "float32", "--raw"]  # fmt: skip
    out = tmp_path / "startup.json"
    argv = [
        "bench",
        "startup",
        "--model",
        model,
        "--max-tokens",
        "2",
        "--output-json",
        str(out),
        "--serve",
        "--",
        *engine,
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    cold, warm = report["cold"], report["warm"]
    assert cold["from_cache"] == 0
    # Programs per bucket (engine/PERFORMANCE.md, start-up): the forward and the prompt-logprobs
    # program per token bucket (1, 4, 16), and per request bucket (1, 4) one sampler program per
    # penalties x grammar variant; logprobs are a runtime flag of the same programs (was 8 per bucket).
    assert cold["programs"] == 2 * 3 + 4 * 2
    assert cold["compiled"] == cold["programs"] and cold["loaded"] == 0
    # The warm start loads every program ahead of time (worker/program_store.py): nothing compiles.
    assert warm["programs"] == cold["programs"] == warm["loaded"] and warm["compiled"] == 0
    # --serve: a server started on the warm cache (less generate's own flags) answered /health.
    assert report["serve_warm"]["healthy_s"] > 0
    flags = ["--raw", "--max-tokens", "2", "--dtype", "float32", "--top-k=3", "--seed", "1"]
    assert engine_flags_only(flags) == ["--dtype", "float32", "--seed", "1"]
    assert warm["warm_up_s"] < cold["warm_up_s"] / 2, report
    phases = ("imports_s", "checkpoint_s", "engine_s", "placement_s", "first_token_s")
    assert set(phases) <= set(warm), warm
    # The logged phases are parts of the run: together they cannot exceed its wall time.
    assert 0 < sum(warm[p] for p in phases if p != "placement_s") < warm["wall_s"], warm


def test_disabled_cache_leaves_jax_alone(tmp_path):
    import jax

    from xlaserve.config import CompilationConfig
    from xlaserve.worker.loading import setup_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    setup_compilation_cache(
        CompilationConfig(compilation_cache_dir=str(tmp_path / "never"), disable_compilation_cache=True)
    )
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "never").exists()

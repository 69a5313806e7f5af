"""Ahead-of-time executables (worker/program_store.py, worker/program.py): a second engine start in a
fresh process loads every warm-up program instead of compiling it, gives the same greedy tokens and
compiles nothing in the steady state (strict guard); a corrupt or mismatched entry compiles again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.tiny_models import TINY_PROCESS_XLA_FLAGS, save_tiny_llama, small_byte_tokenizer
from xlaserve.config import EngineConfig
from xlaserve.worker.compile_guard import num_compiles
from xlaserve.worker.program import Program
from xlaserve.worker.program_store import ProgramStore
from xlaserve.worker.warm_up import _load_or_compile


def _affine(params, x, *, scale):
    return params["w"] * x * scale + params["b"]


def _program() -> Program:
    return Program("affine", jax.jit(_affine, static_argnames=("scale",)), static_argnames=("scale",))


def _entries(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".xex"))


def test_store_loads_what_it_saved_and_compiles_past_a_bad_entry(tmp_path):
    params = {"w": jnp.full(4, 2.0), "b": jnp.ones(4)}
    x = np.arange(4, dtype=np.float32)
    store = ProgramStore(str(tmp_path), max_bytes=2**30, fingerprint="test")
    args = (params, x)
    expected = np.arange(4) * 6.0 + 1
    _, is_loaded = _load_or_compile(store, _program(), args, {"scale": 3.0})
    assert not is_loaded and len(_entries(str(tmp_path))) == 2  # under its settings' key and its text's
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # written, then renamed

    program = _program()
    _, is_loaded = _load_or_compile(store, program, args, {"scale": 3.0})
    assert is_loaded
    np.testing.assert_allclose(program(params, x, scale=3.0), expected)
    # A static value or a shape warm-up never saw goes to the jitted function.
    np.testing.assert_allclose(program(params, x, scale=1.0), np.arange(4) * 2.0 + 1)
    assert len(program.executables) == 1

    # Another machine fingerprint (another jax, device, XLA_FLAGS...) keys apart: compiled, stored beside.
    other = ProgramStore(str(tmp_path), max_bytes=2**30, fingerprint="other")
    assert not _load_or_compile(other, _program(), args, {"scale": 3.0})[1]
    first = store._path(store.key("affine", args, {"scale": 3.0}))
    second = other._path(other.key("affine", args, {"scale": 3.0}))

    def remove_text_entries():  # out of the way of what follows: the first keys' entries alone
        for path in _entries(str(tmp_path)):
            if path not in (first, second):
                os.remove(path)

    remove_text_entries()
    assert _entries(str(tmp_path)) == sorted([first, second])

    # An entry holding another key's executable, a truncated one, a zeroed one: each compiles, and the
    # bad file is replaced by a good one.
    with open(first, "rb") as f:
        good = f.read()
    for damaged in (good, good[:-100], good[:40] + bytes(len(good) - 40)):
        with open(second, "wb") as f:
            f.write(damaged)
        remove_text_entries()
        program = _program()
        assert not _load_or_compile(other, program, args, {"scale": 3.0})[1]
        np.testing.assert_allclose(program(params, x, scale=3.0), expected)
        assert _load_or_compile(other, _program(), args, {"scale": 3.0})[1]  # rewritten

    # Bounded: past max_bytes the least recently used entries go.
    os.utime(first, (1, 1))
    small = ProgramStore(str(tmp_path), max_bytes=os.path.getsize(second), fingerprint="test")
    small.evict()
    assert _entries(str(tmp_path)) == [second]


def test_engines_of_other_settings_share_a_program_by_its_text(tmp_path):
    """Two engines whose settings differ (their first keys) but that run the same program on one machine:
    the second loads it by its lowered text and stores it under its own key as well; a program whose text
    differs compiles."""
    params = {"w": jnp.full(4, 2.0), "b": jnp.ones(4)}
    args, x = (params, np.arange(4, dtype=np.float32)), np.arange(4, dtype=np.float32)
    first = ProgramStore(str(tmp_path), max_bytes=2**30, fingerprint="settings A", machine="this machine")
    second = ProgramStore(str(tmp_path), max_bytes=2**30, fingerprint="settings B", machine="this machine")
    assert not _load_or_compile(first, _program(), args, {"scale": 3.0})[1]
    program, before = _program(), num_compiles()
    assert _load_or_compile(second, program, args, {"scale": 3.0})[1]  # loaded: nothing compiled
    assert num_compiles() == before
    np.testing.assert_allclose(program(params, x, scale=3.0), np.arange(4) * 6.0 + 1)
    own = second._path(second.key("affine", args, {"scale": 3.0}))
    assert own in _entries(str(tmp_path)) and len(_entries(str(tmp_path))) == 3
    assert second.load(second.key("affine", args, {"scale": 3.0}), args, {}) is not None
    # Another static value is another program text: compiled.
    assert not _load_or_compile(second, _program(), args, {"scale": 2.0})[1]
    # Another machine (XLA_FLAGS, devices, the engine's compile options...; the settings' key has it too):
    # compiled.
    elsewhere = ProgramStore(str(tmp_path), max_bytes=2**30, fingerprint="B elsewhere", machine="elsewhere")
    assert not _load_or_compile(elsewhere, _program(), args, {"scale": 3.0})[1]


def test_the_switch_that_turns_the_compilation_cache_off_turns_the_store_off(tmp_path):
    devices = jax.devices()
    on = EngineConfig.from_kwargs(None, compilation_cache_dir=str(tmp_path))
    store = ProgramStore.for_engine(on, {"model_type": "llama"}, devices)
    assert store is not None and store.directory == str(tmp_path / "executables")
    off = EngineConfig.from_kwargs(None, compilation_cache_dir=str(tmp_path), disable_compilation_cache=True)
    assert ProgramStore.for_engine(off, {"model_type": "llama"}, devices) is None
    # A cache directory that cannot be made (here under a file): no store, the engine still starts.
    (tmp_path / "file").write_text("")
    unwritable = EngineConfig.from_kwargs(None, compilation_cache_dir=str(tmp_path / "file" / "xla"))
    assert ProgramStore.for_engine(unwritable, {"model_type": "llama"}, devices) is None

    # The fingerprint moves with the settings that reach a program, not with host-only ones.
    def fingerprint(**settings) -> str:
        config = EngineConfig.from_kwargs(None, compilation_cache_dir=str(tmp_path), **settings)
        return ProgramStore.for_engine(config, {"model_type": "llama"}, devices).fingerprint

    assert fingerprint(max_num_seqs=3) != store.fingerprint != fingerprint(attention_backend="pallas")
    # A program compiled at another optimization level is never loaded for this one.
    assert fingerprint(optimization_level=0) != store.fingerprint != fingerprint(optimization_level=3)
    assert fingerprint(kv_cache_memory=2**22, seed=5, strict_compile_guard=True) == store.fingerprint
    # Nor with the KV connectors', whose programs are their own: host offload, a disaggregated role (a
    # free port each start).
    transfer = {"kv_connector": "JaxConnector", "kv_role": "kv_consumer", "kv_port": 5999}
    assert fingerprint(kv_transfer_config=transfer) == store.fingerprint
    assert fingerprint(kv_offloading_size=1.0) == store.fingerprint


_CACHE_HIT_SCRIPT = """
import contextlib, json, os, sys, jax, jax.numpy as jnp, numpy as np
from xlaserve.worker.program import Program
from xlaserve.worker.program_store import ProgramStore
from xlaserve.worker.warm_up import _fresh_compiles, _load_or_compile
jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/xla")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
def f(x, y):
    return (jnp.where(x > 0.5, x.astype(jnp.bfloat16), 0).astype(jnp.float32) @ y.T).sum(0), jnp.argmax(x, -1)
shapes = {"warmed": (jnp.ones((64, 128)), jnp.ones((32, 128))),
          "ran": (jnp.ones((16, 128)), jnp.ones((8, 128))),
          "cached": (jnp.ones((8, 128)), jnp.ones((4, 128)))}
if sys.argv[2] == "compile":  # the first process: f of both shapes lands in XLA's persistent cache
    for x, y in shapes.values():
        jax.jit(f).lower(x, y).compile()
    sys.exit(0)
store = ProgramStore(sys.argv[1] + "/executables", 2**30, "test")
if sys.argv[2] == "store":  # the second: one shape runs (from XLA's cache) before warm-up of both
    jax.jit(f)(*shapes["ran"])
    for name, (x, y) in shapes.items():  # "cached": XLA's cache left on
        with contextlib.nullcontext() if name == "cached" else _fresh_compiles(store):
            _load_or_compile(store, Program("f", jax.jit(f), num_fixed_args=0), (x, y), {})
    print(len(os.listdir(store.directory)))
    sys.exit(0)
results = {}  # the third loads what the second stored, and runs it
for name, (x, y) in shapes.items():
    program = Program("f", jax.jit(f), num_fixed_args=0)
    is_loaded = _load_or_compile(store, program, (x, y), {})[1]
    results[name] = [is_loaded, float(np.asarray(program(x, y)[0]).sum())]
print(json.dumps(results))
"""


def _run_script(*argv: str) -> str:
    command = [sys.executable, "-c", _CACHE_HIT_SCRIPT, *argv]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()[-1] if result.stdout else ""


def test_the_store_keeps_only_what_warm_up_compiled_itself(tmp_path):
    """An executable XLA's persistent cache gave back serializes without its kernels on CPU (jax 0.10):
    stored, another process fails when it runs it ("Function ... not found"). Warm-up compiles afresh
    what the cache holds, and what jax gives back from memory (a program the process ran before, loaded
    from the cache), or from the cache (left on): each is stored, and the next process loads and runs it."""
    _run_script(str(tmp_path), "compile")
    assert _run_script(str(tmp_path), "store") == "6"  # each program under its two keys
    results = json.loads(_run_script(str(tmp_path), "load"))
    assert results == {
        "warmed": [True, 64 * 32 * 128],
        "ran": [True, 16 * 8 * 128],
        "cached": [True, 8 * 4 * 128],
    }


# One fresh process starts each engine named in argv[2] in turn (so a tensor-parallel engine's start and a
# single-device one's share the process's start-up: its imports are most of a tiny engine's start).
_START = """
import gc, json, os, sys
from xlaserve import LLM, SamplingParams
from xlaserve.worker.compile_guard import num_compiles
stored = os.path.join(os.environ["XLASERVE_CACHE_ROOT"], "xla", "executables")
def entries():
    return {os.path.join(d, f) for d, _, files in os.walk(stored) for f in files}
results = {}
for name, engine_args in json.loads(sys.argv[2]).items():
    entries_before = entries()
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=1,
              kv_cache_memory=2**22, strict_compile_guard=True, **engine_args)
    runner = llm.engine_core.runner
    before = num_compiles()
    outputs = llm.generate(["hello there", "one two three four five six seven"],
                           SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    results[name] = {"tokens": [o.outputs[0].token_ids for o in outputs],
                     "loaded": runner.num_programs_loaded, "compiled": runner.num_programs_compiled,
                     "compiles_after": num_compiles() - before,
                     "new_entries": sorted(entries() - entries_before)}
    llm.shutdown()
    del llm, runner
    gc.collect()
print(json.dumps(results))
"""
# A single-device engine and one on two of eight (fake CPU) devices, in every process.
ENGINES = {"single": {}, "tp2": {"tensor_parallel_size": 2}}


def _start(model: str, cache_root: str) -> dict:
    """Every engine of ENGINES started in one fresh process -> {name: its figures}."""
    xla_flags = f"--xla_force_host_platform_device_count=8 {TINY_PROCESS_XLA_FLAGS}"  # a tiny model
    env = dict(os.environ, XLASERVE_CACHE_ROOT=cache_root, XLA_FLAGS=xla_flags)
    env.pop("XLASERVE_COMPILATION_CACHE_DIR", None)
    env.pop("XLASERVE_DISABLE_COMPILATION_CACHE", None)
    result = subprocess.run(
        [sys.executable, "-c", _START, model, json.dumps(ENGINES)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _executable_of(path: str) -> bytes:
    """A stored entry's serialized executable (the same under both of a program's keys)."""
    import pickle

    from xlaserve.worker.program_store import _DIGEST_BYTES, _MAGIC

    with open(path, "rb") as f:
        return pickle.loads(f.read()[len(_MAGIC) + _DIGEST_BYTES :])[1]


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> dict:
    """A cold start, then a warm one after two of the single-device engine's stored programs were
    damaged: two processes."""
    tmp_path = tmp_path_factory.mktemp("program_store")
    # A 320-token vocabulary: SmolLM2's 49,152 made every sampler program ~150x wider to compile.
    model = save_tiny_llama(str(tmp_path / "model"), tokenizer=small_byte_tokenizer())
    cache_root = str(tmp_path / "cache")
    # The C++ ops built for the session (kernels/cpu_ops.py keys them by source, flags and CPU): the
    # starts here are about XLA's programs, not the compiler's ~5 s for the attention op.
    session_ops = os.path.join(os.environ.get("XLASERVE_CACHE_ROOT", ""), "cpu_kernels")
    if os.path.isdir(session_ops):
        shutil.copytree(session_ops, os.path.join(cache_root, "cpu_kernels"))
    cold = _start(model, cache_root)
    # Two of the single-device engine's programs damaged under both their keys (the settings' and the
    # text's): one truncated, one holding the other's executable.
    by_program: dict[bytes, list[str]] = {}
    for path in cold["single"]["new_entries"]:
        by_program.setdefault(_executable_of(path), []).append(path)
    assert all(len(paths) == 2 for paths in by_program.values())  # each under its two keys
    assert len(by_program) == cold["single"]["compiled"]
    first, second = list(by_program)[:2]
    with open(by_program[first][0], "rb") as f:
        good = f.read()
    for path in by_program[first]:
        with open(path, "wb") as f:
            f.write(good[: len(good) // 2])
    for path in by_program[second]:
        with open(path, "wb") as f:
            f.write(good)
    return {"cold": cold, "warm": _start(model, cache_root)}


@pytest.mark.slow  # two fresh processes, each starting two engines
def test_second_start_in_a_fresh_process_loads_every_program(starts):
    """The single-device engine's warm start: its two damaged programs compile, every other loads,
    nothing compiles after warm-up, and it answers as the cold start did. (That a warm start of an
    undamaged store loads every program, in a fresh process: test_compilation_cache.py's bench startup.)"""
    cold, warm = starts["cold"]["single"], starts["warm"]["single"]
    assert cold["loaded"] == 0 and cold["compiled"] > 2
    assert warm["compiled"] == 2 and warm["loaded"] == cold["compiled"] - 2
    assert warm["compiles_after"] == 0 and warm["tokens"] == cold["tokens"]


@pytest.mark.slow  # the tensor-parallel engine of the processes above
def test_a_tensor_parallel_engine_loads_its_programs_onto_its_own_devices(starts):
    """Two of eight devices: each executable is loaded onto the mesh it was compiled for, in order."""
    cold, warm = starts["cold"]["tp2"], starts["warm"]["tp2"]
    assert cold["loaded"] == 0
    assert warm["loaded"] == cold["compiled"] > 0 and warm["compiled"] == 0
    assert warm["compiles_after"] == 0 and warm["tokens"] == cold["tokens"]

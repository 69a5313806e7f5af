"""Ahead-of-time executables on disk: a warm start loads each warm-up program instead of tracing,
lowering and looking it up in XLA's compilation cache (~0.3 s a program before a cache hit).

An entry is keyed by everything that shapes the program: the engine's fingerprint (xlaserve's own
source, jax/jaxlib, the devices and the CPU's features, XLA_FLAGS, the model's config, the engine
settings that reach a program) and the program's name and abstract arguments (tree, shapes, dtypes,
shardings: the weights are arguments, so their shapes and dtypes key it, not their files). A key
that matches loads; anything else (no entry, a corrupt or truncated file, a checksum or key that does
not match, a load that raises) compiles as before and writes the entry anew.

On a miss, warm-up lowers the program and asks again by its second key: the lowered text on this
machine (`text_key`). Engines of other settings, or another checkpoint of the same shapes, that run
the same program share its entry: the sampler programs of two engines that differ in their request
buckets or speculative decoding, an engine whose settings changed. A compile is stored under both keys.

Several processes may share the directory: an entry is written to a temporary file and renamed into
place (readers see a whole file or none), and a reader whose file is evicted meanwhile still reads it.
Past `max_bytes` the least recently used entries go. Entries are pickles of executables, trusted like
XLA's own compilation cache beside them: only this user's cache directory is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

import xlaserve.kernels
import xlaserve.models
import xlaserve.sharding
from xlaserve.config import EngineConfig
from xlaserve.kernels import cpu_ops
from xlaserve.worker.model_loader import resolve_dtype

logger = logging.getLogger(__name__)

_MAGIC = b"xlaserve-executable-v2\n"
_SUFFIX = ".xex"
_DIGEST_BYTES = 32
_STALE_TEMP_S = 3600.0  # a temporary file this old was left by a writer that died


def _sha256(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _source_digest() -> str:
    """xlaserve's own code: an edit to a model or a kernel (Python or the CPU op's C++) changes the
    programs it traces."""
    roots = [Path(__file__).parents[1]]  # engine/, installed as xlaserve
    roots += [Path(p.__file__).parent for p in (xlaserve.models, xlaserve.kernels, xlaserve.sharding)]
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(p for suffix in ("py", "cc", "h") for p in root.rglob(f"*.{suffix}")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _cpu_features() -> str:
    """An executable compiled for this CPU's instruction set may crash on another's (a home
    directory shared between machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Engine settings that never reach a program: where the weights come from (they are arguments, their
# shapes and dtypes in every key), how many KV blocks (the cache's shape is), host-side policy, and
# the compilation cache's own switches. Every other setting keys the programs.
_HOST_ONLY_SETTINGS = {
    # A pooling runner's programs are a generate runner's (it pools what the forward returns).
    "model": (
        "model",
        "seed",
        "served_model_name",
        "load_format",
        "tokenizer",
        "tokenizer_mode",
        "trust_remote_code",  # the tokenizer's code, not the model's (always xlaserve's own)
        "skip_tokenizer_init",
        "runner",
        "convert",
        "pooler_config",
        "limit_mm_per_prompt",  # the front end's bound on a prompt's images
        "media_io_kwargs",  # the front end's video reading (frames kept)
        "generation_config",  # requests' default sampling: the front end's
        "override_generation_config",
        # (not mm_processor_kwargs: what it changes of a program, the encoder cache's and the tower's
        # bucket shapes, is in its arguments' shapes, which key it anyway)
    ),
    "cache": (
        "enable_prefix_caching",
        "gpu_memory_utilization",
        "kv_cache_memory",
        "num_gpu_blocks_override",
        "kv_events_config",  # the engine core's publishing of its prefix cache's changes
        # The KV connectors move blocks around a step with programs of their own, never stored here:
        # host offload's tiers, disaggregated prefill's role and address (a free port each start).
        "kv_offloading_size",
        "kv_offloading_disk_path",
        "kv_offloading_disk_size",
        "kv_offloading_disk_persist",
        "kv_transfer_config",
    ),
    "scheduler": (
        "policy",
        "max_num_queued_reqs",
        "long_prefill_token_threshold",
        "max_num_partial_prefills",
        "max_long_partial_prefills",
        "enable_chunked_prefill",  # how steps are filled, not what a step's program is
    ),
    "parallel": ("node_rank", "master_addr", "master_port"),
    "compilation": (
        "compilation_cache_dir",
        "disable_compilation_cache",
        "compilation_cache_max_size",
        "strict_compile_guard",
        "enforce_eager",
        "cudagraph_capture_sizes",  # which buckets are compiled; a bucket's program is keyed by its shapes
        "warm_up_plain_sampling_only",  # which sampler variants are compiled ahead, not what they are
    ),
}


def program_settings(config: EngineConfig) -> dict:
    """The engine settings that may shape a program (all but _HOST_ONLY_SETTINGS)."""
    settings = dataclasses.asdict(config)
    for group, names in _HOST_ONLY_SETTINGS.items():
        for name in names:
            settings[group].pop(name)
    return settings


def machine_fingerprint(config: EngineConfig, devices) -> dict:
    """What outside a program's text may change how it compiles or where it runs: xlaserve and jax,
    the devices and the CPU, XLA_FLAGS and the engine's compile options, the CPU ops registered."""
    backend = devices[0].client
    return {
        "format": _MAGIC.decode(),
        "xlaserve": _source_digest(),
        "python": sys.version,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": [backend.platform, backend.platform_version],
        "devices": [[d.id, d.device_kind, d.process_index] for d in devices],
        "cpu": _cpu_features(),
        "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_ENABLE_X64")},
        "compiler_options": config.compilation.compiler_options(),
        # Whether the CPU attention op is in the programs (and registered before any of them loads):
        # the handler of the engine's dtype, if it has one.
        "cpu_ops": backend.platform == "cpu"
        and (target := cpu_ops.attention_target(resolve_dtype(config.model.dtype)[0])) is not None
        and cpu_ops.available(target),
        "cpu_quantized_ops": backend.platform == "cpu"
        and config.model.quantization is not None
        and cpu_ops.available(cpu_ops.QUANTIZED_TARGET),
        "x64": bool(jax.config.jax_enable_x64),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
    }


def engine_fingerprint(config: EngineConfig, hf_config: dict, devices) -> str:
    """Everything outside a program's arguments that may change what it computes or where it runs.
    Not the checkpoint's files: the weights are arguments, so a checkpoint of the same config and
    shapes elsewhere (a re-download, a test's temporary copy) runs the same programs."""
    parts = machine_fingerprint(config, devices)
    parts |= {"hf_config": hf_config, "engine": program_settings(config)}
    return _sha256(json.dumps(parts, sort_keys=True, default=repr))


def abstract_signature(args: tuple, kwargs: dict) -> str:
    """The arguments as a program sees them: tree, shapes, dtypes, shardings (arrays or shape structs)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    described = []
    for leaf in leaves:
        if hasattr(leaf, "shape"):
            sharding = getattr(leaf, "sharding", None)
            described.append(f"{tuple(leaf.shape)}:{leaf.dtype}:{sharding}")
        else:
            described.append(f"{type(leaf).__name__}:{leaf!r}")
    return f"{treedef}|{'|'.join(described)}"


class ProgramStore:
    """Serialized executables in `directory`, at most `max_bytes` of them."""

    def __init__(self, directory: str, max_bytes: int, fingerprint: str, machine: str | None = None):
        self.directory = directory
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.machine = fingerprint if machine is None else machine  # keys text_key
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def for_engine(cls, config: EngineConfig, hf_config: dict, devices) -> ProgramStore | None:
        """The engine's store, or None: with the compilation cache off, or across processes (a
        multi-host engine compiles inline, in the same order on every process)."""
        compilation = config.compilation
        if compilation.disable_compilation_cache or not compilation.compilation_cache_dir:
            return None
        if jax.process_count() > 1:
            return None
        directory = os.path.join(compilation.compilation_cache_dir, "executables")
        fingerprint = engine_fingerprint(config, hf_config, devices)
        machine = _sha256(json.dumps(machine_fingerprint(config, devices), sort_keys=True, default=repr))
        try:
            return cls(directory, compilation.compilation_cache_max_size, fingerprint, machine)
        except OSError as e:  # a read-only or missing home: start anyway, compiling as before
            logger.warning("no store of compiled programs at %s (%s): warm-up compiles them", directory, e)
            return None

    def key(self, name: str, args: tuple, kwargs: dict) -> str:
        return _sha256(self.fingerprint, name, abstract_signature(args, kwargs))

    def text_key(self, lowered, args: tuple, kwargs: dict) -> str:
        """The second key of a program: its lowered text and compile options on this machine, so that
        engines of other settings (or models) running the same program share it (every tiny model's
        sampler on one vocabulary and hidden size, an engine with and without speculative decoding).
        The abstract signature adds what the text does not say: the arguments' Python tree."""
        return _sha256(self.machine, "text", abstract_signature(args, kwargs), lowered.as_text())

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + _SUFFIX)

    def load(self, key: str, args: tuple, call_kwargs: dict):
        """The executable stored under `key`, callable with (args, call_kwargs), or None."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("compiled program %s unreadable (%s): compiling it", path, e)
            return None
        try:
            if not data.startswith(_MAGIC):
                raise ValueError("not an xlaserve executable of this format")
            digest = data[len(_MAGIC) : len(_MAGIC) + _DIGEST_BYTES]
            payload = data[len(_MAGIC) + _DIGEST_BYTES :]
            if hashlib.sha256(payload).digest() != digest:
                raise ValueError("checksum mismatch (truncated or corrupt)")
            stored_key, blob, in_tree, out_tree, device_ids = pickle.loads(payload)
            if stored_key != key:
                raise ValueError("stored for another key")
            if in_tree != jax.tree.structure((args, call_kwargs)):
                raise ValueError("argument tree differs")
            # The devices it runs on, in its own order (a tensor-parallel mesh: a subset of them).
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]
            for target in cpu_ops.targets_called_by(blob):  # registered before XLA looks them up
                if not cpu_ops.available(target):
                    raise ValueError(f"it calls the CPU op {target}, which is not available here")
            executable = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
            )
        except Exception as e:  # any failure to load falls back to compiling
            logger.warning("compiled program %s not loaded (%s): compiling it", path, e)
            self._remove(path)
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return executable

    def save(self, compiled, *keys: str) -> bool:
        """Store `compiled` (a jax.stages.Compiled) under each of `keys`; False if it cannot be
        serialized or written."""
        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
        except Exception as e:
            logger.info("program not stored ahead of time (%s)", e)
            return False
        return all([self._write(key, (key, blob, in_tree, out_tree, device_ids)) for key in keys])

    def copy(self, from_key: str, key: str) -> bool:
        """Store the entry of `from_key` (just loaded) under `key` too."""
        try:
            with open(self._path(from_key), "rb") as f:
                payload = f.read()[len(_MAGIC) + _DIGEST_BYTES :]
            _, *parts = pickle.loads(payload)
        except Exception as e:  # evicted or replaced meanwhile: the next start looks it up again
            logger.info("program not stored under its settings' key (%s)", e)
            return False
        return self._write(key, (key, *parts))

    def _write(self, key: str, entry: tuple) -> bool:
        payload = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
        data = _MAGIC + hashlib.sha256(payload).digest() + payload
        temp = None
        try:
            fd, temp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, self._path(key))  # atomic: a reader sees the whole entry or none
        except OSError as e:
            logger.warning("could not store a compiled program in %s: %s", self.directory, e)
            if temp is not None:
                self._remove(temp)
            return False
        try:
            self.evict()
        except OSError as e:  # the directory went away meanwhile: the next start writes it again
            logger.warning("could not bound the store of compiled programs in %s: %s", self.directory, e)
        return True

    def evict(self) -> None:
        """Remove the least recently used entries past max_bytes, and temporary files left behind."""
        entries, total, now = [], 0, time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    stat = entry.stat()
                except OSError:
                    continue  # removed by another process meanwhile
                if entry.name.startswith(".tmp-"):
                    if now - stat.st_mtime > _STALE_TEMP_S:
                        self._remove(entry.path)
                elif entry.name.endswith(_SUFFIX):
                    entries.append((stat.st_mtime, stat.st_size, entry.path))
                    total += stat.st_size
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(path)
            total -= size

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

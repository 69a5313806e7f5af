"""Compilation and the device runtime: the attention backend, the persistent XLA cache, warm-up, the
compile guard, and where the profiler writes its traces."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from xlaserve.config.checks import require
from xlaserve.config_args import arg

_ATTENTION_BACKENDS = ("auto", "reference", "pallas", "jax-triton")


def default_compilation_cache_dir() -> str:
    """XLASERVE_COMPILATION_CACHE_DIR, else <XLASERVE_CACHE_ROOT, or ~/.cache/xlaserve>/xla."""
    explicit = os.environ.get("XLASERVE_COMPILATION_CACHE_DIR")
    if explicit:
        return explicit
    root = os.environ.get("XLASERVE_CACHE_ROOT") or os.path.join(
        os.path.expanduser("~"), ".cache", "xlaserve"
    )
    return os.path.join(root, "xla")


@dataclass(frozen=True)
class CompilationConfig:
    # The environment-derived defaults are read where the config is built: the front end, whose
    # config the engine core process receives whole.
    attention_backend: str = field(
        default_factory=lambda: os.environ.get("XLASERVE_ATTENTION_BACKEND", "auto"),
        metadata=arg("also XLASERVE_ATTENTION_BACKEND", choices=_ATTENTION_BACKENDS),
    )
    # The persistent XLA compilation cache: on by default, so a second start loads its programs
    # instead of compiling them. Several processes may share it (JAX locks it), and it is bounded:
    # past compilation_cache_max_size bytes the least recently used programs go.
    compilation_cache_dir: str | None = field(
        default_factory=lambda: default_compilation_cache_dir(),
        metadata=arg(
            "persistent XLA compilation cache (default ~/.cache/xlaserve/xla; XLASERVE_CACHE_ROOT moves it)"
        ),
    )
    disable_compilation_cache: bool = field(
        default_factory=lambda: os.environ.get("XLASERVE_DISABLE_COMPILATION_CACHE", "") not in ("", "0"),
        metadata=arg(
            "compile every program at start, caching nothing (also XLASERVE_DISABLE_COMPILATION_CACHE=1)"
        ),
    )
    compilation_cache_max_size: int = field(default=4 * 2**30, metadata=arg("bytes (default: 4 GiB)"))
    strict_compile_guard: bool = field(  # raise (instead of warn) if anything compiles after warm-up
        default=False, metadata=arg("fail a step that compiles after warm-up (default: warn)")
    )
    enforce_eager: bool = field(  # skip warm-up (compile buckets lazily)
        default=False, metadata=arg("skip warm-up compiles")
    )
    # vLLM's cudagraph_capture_sizes: the token buckets warm-up compiles, each step padded to the smallest
    # that holds it (worker/buckets.py). Unset: 1 and 4, then powers of two from 16. A deployment (or a
    # test) that knows its steps' sizes compiles those alone; max_num_batched_tokens is always one of
    # them, so every step fits, and sizes above it are dropped.
    cudagraph_capture_sizes: tuple[int, ...] | None = field(
        default=None,
        metadata=arg(
            "the token buckets to compile, steps padded to the next one (default: 1, 4, then powers of "
            "two from 16 to max_num_batched_tokens, which is always one)"
        ),
    )
    # Warm-up compiles, per request bucket, the sampler's (and verify's) four variants (penalties, a
    # grammar's token bitmask: each on or off) and per token bucket the prompt-logprobs program, each a
    # program over the vocabulary. An engine whose requests never ask for those (a benchmark, a tiny test
    # engine) warms up plain sampling only; the first request that needs another compiles it then (the
    # compile guard warns; a strict one fails the step). No program changes: only which are made ahead.
    warm_up_plain_sampling_only: bool = field(
        default_factory=lambda: os.environ.get("XLASERVE_WARM_UP_PLAIN_SAMPLING_ONLY", "") not in ("", "0"),
        metadata=arg(
            "warm up only the sampler without penalties or a grammar, and no prompt-logprobs program: a "
            "request needing one compiles it (also XLASERVE_WARM_UP_PLAIN_SAMPLING_ONLY=1)"
        ),
    )
    # vLLM's -O levels trade start-up time for speed; here they are XLA's backend (LLVM) optimization
    # level for the engine's programs. Unset: XLA's own (2, or what XLA_FLAGS says). On CPU, level 0
    # compiles ~30-40% faster and runs slower: tiny models, tests, debugging a model's code.
    optimization_level: int | None = field(
        default=None,
        metadata=arg(
            "XLA backend optimization level of the engine's programs, 0-3 (default: XLA's, 2); "
            "0 compiles fastest and runs slowest",
            aliases=("-O",),
        ),
    )

    # vLLM's profiler (VLLM_TORCH_PROFILER_DIR), the JAX way: start_profile/stop_profile (LLM's, or the
    # server's POST /start_profile, /stop_profile) record a jax.profiler trace of the engine core's
    # process into this folder (TensorBoard's profile plugin, Perfetto). None: no profiling.
    profiler_dir: str | None = field(
        default_factory=lambda: os.environ.get("XLASERVE_PROFILER_DIR") or None,
        metadata=arg(
            "a folder for jax.profiler traces taken between start_profile and stop_profile "
            "(also XLASERVE_PROFILER_DIR; the server's POST /start_profile, /stop_profile)"
        ),
    )

    def __post_init__(self):
        require(
            self.compilation_cache_max_size > 0,
            f"compilation_cache_max_size must be > 0 bytes, got {self.compilation_cache_max_size}",
        )
        require(
            self.attention_backend in _ATTENTION_BACKENDS,
            f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            require(
                isinstance(sizes, (list, tuple))
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes),
                f"cudagraph_capture_sizes must be a list of token counts >= 1, got {sizes!r}",
            )
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        require(
            self.optimization_level is None or 0 <= self.optimization_level <= 3,
            f"optimization_level must be 0, 1, 2 or 3, got {self.optimization_level}",
        )

    def compiler_options(self) -> dict | None:
        """`jax.jit`'s compiler_options for the engine's programs (None: XLA's defaults)."""
        if self.optimization_level is None:
            return None
        return {"xla_backend_optimization_level": self.optimization_level}

"""Counts XLA backend compiles, so the engine can prove nothing compiles after warm-up."""

from __future__ import annotations

import logging
import threading

from jax import monitoring

logger = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# JAX reports a backend compile for every program it builds, also one it loads from the persistent
# compilation cache (a new program all the same: after warm-up, a shape escaped the buckets). The
# cache hits are counted apart only to say how many were loaded.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_cache_hits = 0
# The same, counted by the thread that compiled (JAX reports a compile in the thread that asked for it).
_in_thread = threading.local()


def _on_event(event: str, duration_secs: float, **_) -> None:
    global _count, _seconds
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1
            _seconds += duration_secs
        _in_thread.compiles = getattr(_in_thread, "compiles", 0) + 1


def _on_cache_hit(event: str, **_) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _cache_hits += 1
        _in_thread.cache_hits = getattr(_in_thread, "cache_hits", 0) + 1


monitoring.register_event_duration_secs_listener(_on_event)
monitoring.register_event_listener(_on_cache_hit)


def num_compiles() -> int:
    """Programs compiled, or loaded from the persistent cache, in this process so far (all jitted
    functions)."""
    return _count


def num_cache_hits() -> int:
    """Of those, the programs loaded from the persistent compilation cache."""
    return _cache_hits


def num_own_compiles() -> int:
    """Programs the calling thread compiled itself so far: not those loaded from the persistent cache,
    nor those JAX gave back from its in-memory cache of an earlier compile or load (no compile)."""
    return getattr(_in_thread, "compiles", 0) - getattr(_in_thread, "cache_hits", 0)


def compile_seconds() -> float:
    return _seconds


class CompileGuard:
    """After `arm()`, `check(what)` reports any compile since `begin()`: a warning, or an error when
    strict (a missed bucket in warm-up is a latency spike in production)."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.is_armed = False
        self.num_unexpected = 0
        self._seen = num_compiles()

    def arm(self) -> None:
        self.is_armed = True
        self._seen = num_compiles()

    def begin(self) -> None:
        """Start watching: compiles before this (other code in the process) are not ours."""
        self._seen = num_compiles()

    def check(self, what: str) -> None:
        now = num_compiles()
        new, self._seen = now - self._seen, now
        if not self.is_armed or new == 0:
            return
        self.num_unexpected += new
        message = f"{new} XLA compile(s) after warm-up while running {what}: a shape escaped the buckets"
        if self.strict:
            raise RuntimeError(message)
        logger.warning(message)

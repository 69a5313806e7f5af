"""Host memory for XLA's CPU backend: freed buffers stay in the process for the next step.

XLA's CPU runtime mallocs each execution's temporaries and frees them when it ends. glibc serves a
large request with a fresh mmap (or from a thread arena's heap, unmapped again once empty), so every
step faults its temporaries back in, page by page, zeroed by the kernel: the greedy sampler over
[64, 49,152] logits took ~9,200 page faults (36 MiB) and 49 ms of CPU per call, against 0 faults in
most calls and 29 ms with the settings below (engine/PERFORMANCE.md, "Host memory"). Its argmax alone
touches 24 MiB, and once the program also holds the random path's buffers (never run for greedy rows)
the total is past glibc's largest mmap threshold, so it came back fresh on every call.

The settings, all three needed: one malloc arena (thread arenas delete their heaps when empty), an
mmap threshold of 2 GiB (large blocks come from the heap), no trimming of the heap's top. Measured
alternatives: turning mmap off altogether (M_MMAP_MAX=0) doubled the batch-1 TPOT (22 -> 46 ms), as
did the no-trim setting alone (it freezes glibc's mmap threshold at its 128 KiB default); without
one arena, or without no-trim, the sampler still faulted ~6,000 pages per call. The process keeps its
peak heap, which a CPU engine holds in weights and cache anyway. Only where the device is this CPU:
on a GPU host the big buffers live in device memory, and the host's peak (reading a checkpoint)
should go back to the OS.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
ENV = "XLASERVE_KEEP_HOST_MEMORY"  # "0" turns it off
_applied = False


def device_is_host_cpu() -> bool:
    """Whether jax will run on this CPU, decided without initializing jax (its thread pools pick
    their malloc arenas when they start, so the settings must come first)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def keep_host_memory() -> bool:
    """Apply the settings once per process (glibc on Linux, CPU device); True if they are in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux") or not device_is_host_cpu():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_THRESHOLD, 2**31 - 1),
            (_M_TRIM_THRESHOLD, 2**31 - 1),
        )
    )
    if _applied:
        logger.debug("host memory: one malloc arena, mmap threshold 2 GiB, no trim (%s=0: off)", ENV)
    return _applied

"""Supervision of the engine core: a dead core is restarted, not fatal, until it keeps dying.

When the core dies (its process ends, seen by `watch_core`'s monitor thread, or the front end
reports a failed core with `core_died`), the requests it held fail at once (`on_down`), new ones get
EngineDeadError (503) while a new core starts (warm: its programs come from the store of
executables), then serving resumes (`on_ready` reattaches the front end's output loop). A core that
keeps dying (`RestartPolicy`) sets `failed`, and the server exits; a multi-host core is never
restarted (`RestartPolicy.for_num_nodes`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from xlaserve.engine.core_client import EngineCoreClient, EngineDeadError, cancel_quietly
from xlaserve.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)

# What clients are told (the core's pid, signal and exception stay in the log).
_RESTARTING_REASON = "the engine core stopped unexpectedly and is being restarted; retry in a few seconds"
_FAILED_REASON = "the engine core failed repeatedly and the server is shutting down"


class EngineState(enum.Enum):
    READY = "ready"
    RESTARTING = "restarting"  # the core died; a new one is starting
    FAILED = "failed"  # the core kept dying: no more restarts, the server should exit


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead engine core is restarted, and when the front end gives up (and the server exits 1,
    so that systemd or Kubernetes restarts the whole thing: a core that keeps dying will not heal here).

    `max_restarts`: at most this many deaths within `window_s` seconds are followed by a restart;
    0 never restarts.
    """

    max_restarts: int = 2
    window_s: float = 60.0

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"engine_restart_window must be > 0 seconds, got {self.window_s}")

    def for_num_nodes(self, nnodes: int) -> RestartPolicy:
        """This policy for an engine spanning `nnodes` hosts: a multi-host core is never restarted."""
        if nnodes > 1 and self.max_restarts:
            # The other hosts joined the dead core's jax.distributed group and cannot join a new one.
            logger.info("a multi-host engine is not restarted in place: the server exits if its core dies")
            return RestartPolicy(0, self.window_s)
        return self


class CoreDeaths:
    """The core's deaths, judged by a RestartPolicy.

    Two counts, because a window alone misses a slow crash loop: a core whose start-up takes longer
    than the window and then always fails would be restarted forever. So deaths in a row with no
    ready core in between also count, whatever time they span.
    """

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._times: deque[float] = deque()
        self._num_since_ready = 0

    def record(self, now: float) -> bool:
        """Record a death at `now` (monotonic seconds); whether the core may be restarted."""
        self._times.append(now)
        while now - self._times[0] > self.policy.window_s:
            self._times.popleft()
        self._num_since_ready += 1
        limit = self.policy.max_restarts
        return len(self._times) <= limit and self._num_since_ready <= limit

    def mark_ready(self) -> None:
        self._num_since_ready = 0


class CoreSupervisor:
    """Owns the front end's core client across restarts: `core` is the live one, `errored_reason`
    (None when READY) is what refused requests are told, `failed` is set when it gives up.

    `start_core()` spawns a new core; `on_down(error)` fails what the front end has in flight;
    `detach()` stops reading the dead core; `on_ready()` starts reading a new one.
    """

    def __init__(
        self,
        start_core: Callable[[], EngineCoreClient],
        policy: RestartPolicy,
        metrics: EngineMetrics,
        *,
        on_down: Callable[[EngineDeadError], None],
        detach: Callable[[], Awaitable[None]],
        on_ready: Callable[[], None],
    ):
        self._start_core = start_core
        self._deaths = CoreDeaths(policy)
        self._metrics = metrics
        self._on_down, self._detach, self._on_ready = on_down, detach, on_ready
        self.core = start_core()
        self.state = EngineState.READY
        self.errored_reason: str | None = None
        self.failed = asyncio.Event()
        self._restart_task: asyncio.Task | None = None
        self._is_stopping = False

    def watch_core(self) -> None:
        """Watch the live core's process: its death, noticed on the monitor's thread, is handled on
        this event loop (`core_died`)."""
        client, loop = self.core, asyncio.get_running_loop()
        client.watch(lambda reason: loop.call_soon_threadsafe(self.core_died, client, reason))

    def core_died(self, client: EngineCoreClient, reason: str) -> None:
        """Fail what the core held, then restart it or give up. `reason` (pid, signal, exception) is
        for the log only. A late notice about a core already replaced, or while stopping, is ignored."""
        if self._is_stopping or client is not self.core or self.state is not EngineState.READY:
            return
        may_restart = self._deaths.record(time.monotonic())
        self.state = EngineState.RESTARTING if may_restart else EngineState.FAILED
        self.errored_reason = _RESTARTING_REASON if may_restart else _FAILED_REASON
        logger.error("%s: in-flight requests fail", reason)
        self._metrics.record_core_down()
        self._on_down(EngineDeadError(self.errored_reason))
        if may_restart:
            self._restart_task = asyncio.create_task(self._restart(), name="engine-core-restart")
        else:
            self._give_up()

    async def stop(self) -> None:
        """From here on a core that dies is not restarted; a restart under way is cancelled."""
        self._is_stopping = True
        await cancel_quietly(self._restart_task)

    async def _restart(self) -> None:
        """Replace the dead core by a new one; one that dies while starting counts as another death."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._detach()
                # Reap the old process first: it may still hold the accelerator's memory (and when the
                # front end's output loop failed, it is still running).
                await loop.run_in_executor(None, self.core.stop_process)
                self.core.close()
                started = time.monotonic()
                logger.warning("restarting the engine core")
                self.core = self._start_core()
                self._metrics.num_core_restarts += 1
                try:
                    await self.core.wait_ready()
                    break
                except EngineDeadError as e:
                    logger.error("%s", e)
                    if not self._deaths.record(time.monotonic()):
                        self._give_up()
                        return
        except Exception:  # never leave the server refusing requests forever
            logger.exception("restarting the engine core failed")
            self._give_up()
            return
        self._deaths.mark_ready()
        self._on_ready()
        self.state, self.errored_reason = EngineState.READY, None
        elapsed = time.monotonic() - started
        logger.info("engine core restarted in %.1fs (pid %d): serving again", elapsed, self.core.pid)

    def _give_up(self) -> None:
        policy = self._deaths.policy
        self.state, self.errored_reason = EngineState.FAILED, _FAILED_REASON
        logger.critical(
            "the engine core keeps dying (limit: %d restarts within %.0fs, or in a row): giving up",
            policy.max_restarts,
            policy.window_s,
        )
        self.failed.set()

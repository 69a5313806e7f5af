"""A step in flight, and where a step's time goes.

With async scheduling the engine core dispatches step N+1 before it reads step N's results, so the
runner hands back a `StepFuture` instead of the results: `result()` blocks on the device arrays,
brings them to the host and builds the ModelRunnerOutput. `failed_req_ids` (requests whose host work
raised while the step was prepared) is known at once, so the core can finish them before it schedules
again.

`StepTiming` counts the two idle times of a step: the host blocked on the device (`host_wait_s`),
and the device, done with a step, waiting for the host to dispatch the next (`device_idle_s`: the gap
between a step's results being ready and the next dispatch). When results are ready is known exactly
when the host blocks on them; for a step whose results are read only after the next dispatch (async),
the watcher thread (`watch=True`, what `xlaserve bench` turns on) sees the moment, else the time the
host read them stands for it, which undercounts that gap.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import jax

from xlaserve.core.outputs import ModelRunnerOutput


class StepFuture:
    """The outputs of one dispatched step, read on demand (once)."""

    def __init__(
        self,
        read: Callable[[], ModelRunnerOutput] | None = None,
        failed_req_ids: frozenset[str] = frozenset(),
        output: ModelRunnerOutput | None = None,
    ):
        self._read = read
        self._output = output
        self.failed_req_ids = failed_req_ids

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> StepFuture:
        """A step whose outputs are already on the host (nothing scheduled, or a synchronous executor)."""
        return cls(output=output, failed_req_ids=frozenset(output.failed_req_ids))

    def result(self) -> ModelRunnerOutput:
        """Block until the step is done; its outputs (the same object on every call)."""
        if self._output is None:
            self._output, self._read = self._read(), None
        return self._output


class _Step:
    """One dispatched step's timestamps (perf_counter seconds)."""

    __slots__ = ("is_watched", "next_dispatch", "ready", "ready_event", "watched")

    def __init__(self):
        self.ready: float | None = None  # its results were ready on the device
        self.next_dispatch: float | None = None  # the next step was dispatched
        self.ready_event = threading.Event()
        self.watched = None  # the array the watcher blocks on
        self.is_watched = False


class StepTiming:
    """Host-idle and device-idle seconds over the steps run so far."""

    def __init__(self, watch: bool = False):
        self.num_steps = 0
        self.host_wait_s = 0.0  # the host blocked on the device's results
        self.device_idle_s = 0.0  # the device waited for the host between two steps
        self.watch = watch
        self._last: _Step | None = None
        self._queue: queue.Queue | None = None

    def on_dispatch(self) -> _Step:
        """Before a step is dispatched: the device has idled since the previous step was ready."""
        now = time.perf_counter()
        prev = self._last
        if prev is not None:
            if prev.ready is not None:
                self.device_idle_s += max(0.0, now - prev.ready)
            else:
                prev.next_dispatch = now  # counted once its ready time is known
        self._last = _Step()
        return self._last

    def on_dispatched(self, step: _Step, array: jax.Array) -> None:
        """After the dispatch: let the watcher see when `array` (the step's sampled ids) is ready."""
        if not self.watch:
            return
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._watch_loop, name="xlaserve-step-watch", daemon=True).start()
        step.watched, step.is_watched = array, True
        self._queue.put(step)

    def on_read(self, step: _Step, wait_s: float) -> None:
        """The host read the step's results after blocking `wait_s` seconds."""
        now = time.perf_counter()
        self.host_wait_s += wait_s
        self.num_steps += 1
        if step.is_watched:
            step.ready_event.wait()
        if step.ready is None:
            step.ready = now
        if step.next_dispatch is not None:
            self.device_idle_s += max(0.0, step.next_dispatch - step.ready)

    def _watch_loop(self) -> None:
        while True:
            step = self._queue.get()
            try:
                jax.block_until_ready(step.watched)
            except Exception:  # the reader sees the error; the time is then meaningless anyway
                pass
            step.ready, step.watched = time.perf_counter(), None
            step.ready_event.set()

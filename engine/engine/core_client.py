"""The front end's handle on the engine core process: spawn it, talk to it over ZMQ, watch it die.

Input goes out on a PUSH socket with non-blocking sends (a wedged core must never freeze the event
loop); outputs come back on a PULL socket read by asyncio. A thread waits on the process's
sentinel, so a dead core is noticed at once, not when the next request times out.

One client is one core process: a restart (engine/supervisor.py, which also decides when to give
up) builds a new client with fresh sockets, so no message meant for the dead core can reach its
successor.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

import zmq
import zmq.asyncio

from xlaserve.config import EngineConfig
from xlaserve.engine.core_proc import run_engine_core
from xlaserve.engine.protocol import (
    CoreOutput,
    EngineDead,
    EngineReady,
    Shutdown,
    make_encoder,
    make_output_decoder,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone (or restarting); nothing can be generated until it is back.

    The messages AsyncLLM raises it with reach clients, so they hold no pid or exception text (the log
    has those); the start-up failure `wait_ready` raises goes to the log and the command line only.
    """


class EngineCoreClient:
    """Spawns `run_engine_core` and owns the front end's ends of its sockets. The core is built from
    `config` as the front end built it (one EngineConfig per engine, pickled into the spawn)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO"):
        self._ipc_dir = tempfile.mkdtemp(prefix="xlaserve-")
        input_address = f"ipc://{os.path.join(self._ipc_dir, 'input')}"
        output_address = f"ipc://{os.path.join(self._ipc_dir, 'output')}"
        # A plain socket for input, so a non-blocking send raises zmq.Again at once.
        self._zmq_sync = zmq.Context()
        self._input = self._zmq_sync.socket(zmq.PUSH)
        self._zmq = zmq.asyncio.Context()
        self._input.bind(input_address)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.bind(output_address)
        self._encoder = make_encoder()
        self._decoder = make_output_decoder()
        self.is_shutting_down = False
        self.shutdown_timeout_s = config.core_shutdown_timeout_s
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core,
            args=(config, input_address, output_address, os.getpid(), log_level),
            name="xlaserve-engine-core",
            daemon=True,  # multiprocessing also terminates it if this interpreter exits
        )
        self.process.start()
        logger.info("engine core process started (pid %d)", self.process.pid)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    async def wait_ready(self) -> EngineReady:
        """Wait for the core's start-up (weights, warm-up compiles); fail at once if it dies."""
        while True:
            if await self._output.poll(100):
                message = await self.recv()
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"the engine core failed to start: {message.reason}")
                continue
            if not self.process.is_alive():
                self.process.join(0.5)  # reap it, for the exit code
                how = _describe_exit(self.process.exitcode)
                pid = self.process.pid
                raise EngineDeadError(f"the engine core process (pid {pid}) {how} during start-up")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` (from a thread) when the process ends without being asked to."""

        def monitor() -> None:
            wait([self.process.sentinel])
            if not self.is_shutting_down:
                self.process.join(0.5)  # reap it, for the exit code
                how = _describe_exit(self.process.exitcode)
                on_death(f"the engine core process (pid {self.process.pid}) {how}")

        threading.Thread(target=monitor, name="engine-core-monitor", daemon=True).start()

    def send(self, message) -> None:
        """Queue a message for the core without blocking; EngineDeadError if it cannot take it."""
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again as e:
            raise EngineDeadError("the engine core is not reading its input") from e

    async def recv(self) -> CoreOutput:
        frame = await self._output.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the core and close the sockets. Idempotent. `timeout`: how long the core may take to
        stop by itself (None: as long as its config needs, `EngineConfig.core_shutdown_timeout_s`)."""
        self.stop_process(self.shutdown_timeout_s if timeout is None else timeout)
        self.close()

    def stop_process(self, timeout: float = 5.0) -> None:
        """Stop the core: ask politely (unless timeout is 0), then SIGTERM, then SIGKILL; the monitor
        stays quiet.

        Blocks for up to ~timeout + 4 s; safe to run in a worker thread (it only sends on the input
        socket, which nothing else uses once the core is being stopped).
        """
        if self.is_shutting_down:
            return
        self.is_shutting_down = True
        if timeout > 0 and self.process.is_alive():
            try:
                self.send(Shutdown())
            except (EngineDeadError, zmq.ZMQError):
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("engine core did not stop within %.0fs: terminating it", timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)

    def close(self) -> None:
        """Close the sockets (on the event loop's thread: the output socket belongs to it)."""
        if self._zmq.closed:
            return
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq_sync.term()
        self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


async def cancel_quietly(task: asyncio.Task | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001, S110 - it is being thrown away
        pass

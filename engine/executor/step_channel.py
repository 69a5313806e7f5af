"""The step channel of a multi-host engine (executor/multihost.py): process 0's `StepSender` and each
follower's `StepReceiver`, over ZMQ.

Before each step process 0 sends the step's host arrays (worker/input_batch.StepInputs) to every
follower; each runs the step and answers with a checksum of the ids it sampled (with pipeline stages on
several processes, its step's outputs instead), so a process that diverged stops the engine with a clear
error instead of hanging. Between steps the same channel carries the research stack's calls
(executor/follower_calls.py). A follower that loses process 0 stops (`ProcessZeroLost`), or, lost
during a step, exits.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
import zlib

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from xlaserve.executor.follower_calls import Call
from xlaserve.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

_READY = b"ready"
# What process 0 sends (the first frame of each message): a step, a call of the research stack, the end.
_STEP, _CALL, _STOP = b"step", b"call", b"stop"
# How long a follower waits on a connection to process 0 that answers nothing (not even ZMQ's heartbeats)
# before it stops: far longer than a busy host's scheduling hiccup, far shorter than a hang.
LIVENESS_TIMEOUT_S = 20.0


def _checksum(token_ids: np.ndarray) -> bytes:
    return zlib.crc32(np.ascontiguousarray(token_ids, np.int32).tobytes()).to_bytes(4, "little")


def _pack(host: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **host)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


class StepSender:
    """Process 0's end: waits for every follower, then sends each step and checks their answers."""

    def __init__(self, master_addr: str, port: int, num_followers: int, timeout_s: float = 600.0):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        _bind(self._sock, f"tcp://{master_addr}:{port}")
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._peers: list[bytes] = []
        while len(self._peers) < num_followers:
            identity, message = self._sock.recv_multipart()
            if message == _READY:
                self._peers.append(identity)
        self._num_steps = 0

    def send(self, inputs: StepInputs) -> None:
        data = inputs.to_bytes()
        for peer in self._peers:
            self._sock.send_multipart([peer, _STEP, data])

    def call(self, call: Call) -> None:
        """Run `call` on every follower; a follower's failure is a RuntimeError naming its process (process
        0 ran it first, so the processes' weights may now differ: the engine cannot go on)."""
        self.send_call(call)
        failures = self.call_failures(call)
        if failures:
            raise RuntimeError(
                f"{call.method} ran on process 0 but failed on {'; '.join(failures)}: the processes' "
                "weights differ now; restart the engine"
            )

    def send_call(self, call: Call) -> None:
        """Start `call` on every follower (`call_failures` waits for their answers)."""
        frames = call.to_frames()
        for peer in self._peers:
            self._sock.send_multipart([peer, _CALL, *frames])

    def call_failures(self, call: Call) -> list[str]:
        """Every follower's answer to `call`, sent before: what failed, "process N: error" each."""
        failures = []
        for _ in self._peers:
            try:
                identity, answer = self._sock.recv_multipart()
            except zmq.Again:
                raise RuntimeError(f"a follower process did not answer {call.method} in time") from None
            if answer:
                failures.append(f"process {identity.decode()}: {answer.decode()}")
        return failures

    def check(self, token_ids: np.ndarray) -> None:
        """Compare every follower's sampled ids with ours (a checksum); divergence is fatal."""
        expected = _checksum(token_ids)
        for _ in self._peers:
            try:
                identity, answer = self._sock.recv_multipart()
            except zmq.Again:
                raise RuntimeError("a follower process did not answer a step in time; stopping") from None
            if answer != expected:
                raise RuntimeError(
                    f"multi-host divergence at step {self._num_steps}: process {identity.decode()} sampled "
                    "different token ids than process 0; stopping"
                )
        self._num_steps += 1

    def receive_outputs(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A pipelined step's outputs: `host` (this process's, empty unless it sampled) or the one
        follower's that sampled (each follower answers, with its outputs or nothing)."""
        for _ in self._peers:
            try:
                _, answer = self._sock.recv_multipart()
            except zmq.Again:
                raise RuntimeError("a follower process did not answer a step in time; stopping") from None
            host = host or _unpack(answer)
        if "token_ids" not in host:
            raise RuntimeError(
                f"no process sampled step {self._num_steps} (the last pipeline stage's should)"
            )
        self._num_steps += 1
        return host

    def close(self) -> None:
        for peer in self._peers:
            self._sock.send_multipart([peer, _STOP])
        self._sock.close()


class ProcessZeroLost(RuntimeError):
    """A follower lost process 0 (dead, or its host unreachable): the engine cannot go on."""


def _bind(sock: zmq.Socket, address: str, timeout_s: float = 10.0) -> None:
    """Bind `address`, waiting for the previous engine's sender there to let go of it: ZMQ closes a socket
    in its I/O thread, after `close` returns, so the next engine of the same processes may find the port
    still taken for a few milliseconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class StepReceiver:
    """A follower's end: announces itself, then yields each step until process 0 stops.

    A follower waits in `recv` between steps, for as long as process 0 has no requests; if process 0 dies
    meanwhile, `recv` raises instead of waiting forever. What it watches is the connection, not the
    traffic: ZMQ heartbeats, which process 0's ZMQ I/O thread answers whether its engine is idle, busy or
    compiling, close a connection silent for `liveness_timeout_s` (a host gone: no FIN ever comes), and a
    killed process 0's kernel closes it at once; a socket monitor reports the disconnect.

    A step or call in flight is watched too: the main thread is then away from `recv`, maybe blocked in one
    of the step's collectives, which cannot complete without process 0 and cannot be cancelled (left alone,
    a process 0 gone silent leaves it to JAX's heartbeat timeout, 100 s, to abort the process). So a thread
    owns the monitor from start to `close`: between steps it wakes `recv`, which raises ProcessZeroLost;
    during a step or call it logs the cause and exits the process, code 1, as the CLI's follower does on
    ProcessZeroLost."""

    def __init__(
        self, master_addr: str, port: int, node_rank: int, liveness_timeout_s: float = LIVENESS_TIMEOUT_S
    ):
        self._process_0, self._node_rank = f"{master_addr}:{port}", node_rank
        self._liveness_timeout_s = liveness_timeout_s
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, str(node_rank).encode())
        self._sock.setsockopt(zmq.LINGER, 1000)
        # A ping every quarter of the bound, and the connection closed when none is answered in the rest
        # of it; the TTL asks process 0 to drop this follower's connection as soon, should this host go.
        interval_ms = int(liveness_timeout_s * 250)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(liveness_timeout_s * 1000) - interval_ms)
        self._sock.setsockopt(zmq.HEARTBEAT_TTL, int(liveness_timeout_s * 1000))
        monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        # A pair of inproc sockets between `recv` and the watch thread: "lost" one way, "stop" (`close`) the
        # other; ZMQ sockets are not shared between threads.
        self._wake, watch_end = _inproc_pair(f"inproc://process-0-watch-{id(self)}")
        # Whether a step or call is in flight (from `recv` returning it until it is answered), and whether
        # process 0 is lost: both under the lock, so that a step that arrives as process 0 is lost is never
        # started.
        self._lock = threading.Lock()
        self._is_busy = self._is_lost = False
        self._watch = threading.Thread(
            target=self._watch_link, args=(monitor, watch_end), name="process-0-watch", daemon=True
        )
        self._sock.connect(f"tcp://{self._process_0}")
        self._sock.send(_READY)
        self._watch.start()

    def recv(self) -> StepInputs | Call | None:
        """The next step or call (in flight until answered), or None once process 0 stops."""
        kind, *frames = self._recv_multipart()
        if kind not in (_STEP, _CALL):
            return None
        with self._lock:
            if self._is_lost:  # its collectives would never complete
                raise ProcessZeroLost(self._lost_message())
            self._is_busy = True
        return StepInputs.from_bytes(frames[0]) if kind == _STEP else Call.from_frames(frames)

    def _recv_multipart(self) -> list[bytes]:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        if self._sock in dict(poller.poll()):
            return self._sock.recv_multipart()
        # Lost. What process 0 sent before its socket closed (the stop of a shut-down engine) may reach the
        # socket just after the monitor's event.
        if self._sock.poll(100):
            return self._sock.recv_multipart()
        raise ProcessZeroLost(self._lost_message())

    def _lost_message(self, during_step: bool = False) -> str:
        lost = (
            f"process {self._node_rank}: lost process 0 (its step channel at {self._process_0} disconnected, "
            f"or was silent for {self._liveness_timeout_s:g} s)"
        )
        if during_step:
            return (
                f"{lost} during a step or call, whose collectives cannot complete without it: this follower "
                "exits (code 1)"
            )
        return f"{lost}: process 0 died or its host is unreachable; this follower stops"

    def _watch_link(self, monitor: zmq.Socket, wake: zmq.Socket) -> None:
        """The watch thread, until `close`: the connection's events, and what process 0's loss means now."""
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        # Only a connection that was up can be lost: until process 0 binds (it warms up first), ZMQ retries.
        is_connected = False
        try:
            while wake not in dict(poller.poll()):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    is_connected = True
                elif is_connected and not self._is_lost:
                    self._lose(wake)
        finally:
            monitor.close()
            wake.close()

    def _lose(self, wake: zmq.Socket) -> None:
        with self._lock:
            self._is_lost = True
            if not self._is_busy:
                wake.send(b"")  # `recv` raises
                return
        # The main thread may be blocked in a collective for good: nothing short of exiting frees it.
        logger.error("%s", self._lost_message(during_step=True))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def report(self, token_ids: np.ndarray) -> None:
        self._answer(_checksum(token_ids))

    def send_outputs(self, host: dict[str, np.ndarray]) -> None:
        """A pipelined step's outputs (empty where this process sampled nothing)."""
        self._answer(_pack(host))

    def answer_call(self, error: str | None) -> None:
        self._answer((error or "").encode())

    def _answer(self, data: bytes) -> None:
        """The step or call in flight is done: back to `recv`, where losing process 0 raises."""
        with self._lock:
            self._is_busy = False
        self._sock.send(data)

    def close(self) -> None:
        # The monitor first, while the watch thread still reads it: libzmq sends its events blocking, under
        # a lock `disable_monitor` takes, so an event (process 0 closing its end) sent after the watch
        # thread closed its end would hang this call for good.
        self._sock.disable_monitor()
        self._wake.send(b"")  # the watch thread stops
        self._watch.join()
        self._wake.close()
        self._sock.close()


def _inproc_pair(address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Two PAIR sockets joined at `address`, one for each of two threads."""
    ctx = zmq.Context.instance()
    ends = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for end in ends:
        end.setsockopt(zmq.LINGER, 0)
    ends[0].bind(address)
    ends[1].connect(address)
    return ends

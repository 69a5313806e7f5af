"""Multi-host engines: process 0 sends each step to the other processes.

Every process holds the model's shards for its devices and runs the same jitted step; only
process 0 schedules. Before each step it sends the step's host arrays (worker/input_batch.StepInputs)
to the other processes over ZMQ; they run the step and answer with a checksum of the ids they
sampled, so a process that diverged stops the engine with a clear error instead of hanging.
With pipeline stages on several processes (executor/pipeline.py) only the last stage's process
samples: the followers answer with their step's outputs instead (empty where nothing was sampled).

The research stack (worker/weight_update.py) goes the same way, as a `Call` between steps: process 0
runs it first (a caller's error, a wrong name or shape, then changes nothing anywhere), then every
follower runs it on its own shards and answers; `update_weights`' arrays travel as host bytes (each
process cuts its own shards from them, as a load does), `update_weights_from_path` as the path (each
process reads the checkpoint itself, as at start). Pipeline stages across processes update in two
phases (executor/pipeline.py): every process prepares its own stages' new weights, and only once all
have is each told to commit them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Mapping

import jax
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from xlaserve.config import EngineConfig, ParallelConfig
from xlaserve.core.outputs import ModelRunnerOutput, ScheduledRequest
from xlaserve.executor.executor import Executor
from xlaserve.lora_request import LoRARequest
from xlaserve.worker import sleep_mode, weight_update
from xlaserve.worker.input_batch import StepInputs
from xlaserve.worker.loading import LoadedCheckpoint
from xlaserve.worker.model_runner import ModelRunner
from xlaserve.worker.step_future import StepFuture
from xlaserve.worker.step_output import make_output

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


@dataclasses.dataclass(frozen=True)
class Call:
    """Host work for every follower between steps: a research-stack call (`method` of
    worker/weight_update.py, or of worker/sleep_mode.py for sleep and wake_up, with `args`, and for
    update_weights or prepare_update the arrays, host copies sent as their bytes), or
    "put_lora_in_slot" (slot, LoRARequest fields): an adapter process 0 wrote into a slot while
    preparing the next step."""

    method: str
    args: tuple = ()
    weights: dict[str, np.ndarray] | None = None

    def __post_init__(self):
        if self.method not in _FOLLOWER_CALLS:
            raise ValueError(f"no call {self.method!r} between steps (known: {', '.join(_FOLLOWER_CALLS)})")

    def to_frames(self) -> list[bytes]:
        weights = self.weights or {}
        header = {
            "method": self.method,
            "args": list(self.args),
            "weights": [[name, a.dtype.name, list(a.shape)] for name, a in weights.items()],
        }
        return [json.dumps(header).encode(), *(np.ascontiguousarray(a).data for a in weights.values())]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Call:
        header = json.loads(frames[0])
        weights = {
            name: np.frombuffer(data, jax.numpy.dtype(dtype)).reshape(shape)
            for (name, dtype, shape), data in zip(header["weights"], frames[1:], strict=True)
        }
        return cls(header["method"], tuple(header["args"]), weights if header["weights"] else None)

    def run(self, runner: ModelRunner):
        args = (self.weights,) if self.method in _TAKES_WEIGHTS else self.args
        return _FOLLOWER_CALLS[self.method](runner, *args)


def _put_lora_in_slot(runner: ModelRunner, slot: int, *lora) -> None:
    runner.lora.put_in_slot(slot, LoRARequest(*lora))


# What a follower runs between steps, by the name process 0 sends: nothing else is looked up by name.
_FOLLOWER_CALLS = {
    "put_lora_in_slot": _put_lora_in_slot,
    "update_weights": weight_update.update_weights,
    "update_weights_from_path": weight_update.update_weights_from_path,
    "prepare_update": weight_update.prepare_update,
    "prepare_update_from_path": weight_update.prepare_update_from_path,
    "commit_update": weight_update.commit_update,
    "abort_update": weight_update.abort_update,
    "sleep": sleep_mode.sleep,
    "wake_up": sleep_mode.wake_up,
}
# The calls whose one argument is the arrays sent as bytes (`weights`), not `args`.
_TAKES_WEIGHTS = frozenset({"update_weights", "prepare_update"})


def host_weights(weights: Mapping | Iterable) -> dict[str, np.ndarray]:
    """update_weights' arrays as host copies, to send: a jax array must be whole in this process."""
    out = {}
    for name, array in weight_update.named_arrays(weights).items():
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            raise ValueError(
                f"weights: {name!r} spans several processes; across hosts update_weights takes arrays "
                "process 0 holds whole (or use update_weights_from_path)"
            )
        out[name] = np.asarray(array)
    return out


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
        self._wake.send(b"")  # the watch thread stops
        self._watch.join()
        self._sock.disable_monitor()
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


class MultiHostExecutor(Executor):
    """Process 0's executor: each step is sent to every follower, run here, and checked against
    the followers' answers."""

    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint, devices=None):
        super().__init__(config, checkpoint, devices)
        self.sender: StepSender | None = None

    def start(self) -> None:
        """Warm up, then wait for the followers (each connects once its own warm-up is done), so
        every process compiles at the same time instead of one after the other."""
        super().start()
        parallel = self.config.parallel
        self.sender = StepSender(parallel.master_addr, step_port(parallel), parallel.nnodes - 1)

    def execute(
        self, scheduled: list[ScheduledRequest], grammar_bitmask: np.ndarray | None = None
    ) -> ModelRunnerOutput:
        if not scheduled:
            return ModelRunnerOutput()
        inputs = self.runner.prepare(scheduled, grammar_bitmask)
        for slot, lora in self.runner.lora.take_loads() if self.runner.lora is not None else ():
            self.sender.call(
                Call("put_lora_in_slot", (slot, lora.lora_name, lora.lora_int_id, lora.lora_path))
            )
        self.sender.send(inputs)
        host = self._answered(self.runner.run(inputs))
        return make_output(scheduled, host, inputs.failed_req_ids, self.runner.hooks)

    def _answered(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The step's outputs, once the followers have answered: every process sampled the same ids."""
        self.sender.check(host["token_ids"])
        return host

    def execute_async(
        self,
        scheduled: list[ScheduledRequest],
        grammar_bitmask: np.ndarray | None = None,
        kv_connector_metadata=None,
    ) -> StepFuture:
        """Synchronous here (EngineConfig turns async scheduling off for several processes): the
        followers' checksums are checked before the next step is sent. No KV connector runs on several
        hosts (EngineConfig refuses it): `kv_connector_metadata` is always None."""
        return StepFuture.done(self.execute(scheduled, grammar_bitmask))

    def update_weights(self, weights) -> list[str]:
        weights = host_weights(weights)
        return self._everywhere(Call("update_weights", weights=weights))

    def update_weights_from_path(self, path: str) -> list[str]:
        return self._everywhere(Call("update_weights_from_path", (path,)))

    def sleep(self, level: int) -> sleep_mode.MemoryReport:
        return self._everywhere(Call("sleep", (level,)))

    def wake_up(self) -> sleep_mode.MemoryReport:
        return self._everywhere(Call("wake_up"))

    def apply_model(self, func) -> list:
        raise self._no_python_call("apply_model")

    def collective_rpc(self, method, args: tuple, kwargs: dict):
        raise self._no_python_call("collective_rpc")

    def _no_python_call(self, what: str) -> ValueError:
        # A follower runs only the calls it knows by name (Call), and process 0's arrays span hosts.
        return ValueError(
            f"{what} runs on one host: the other processes of a multi-host engine "
            f"(nnodes={self.config.parallel.nnodes}) run only the engine's own calls"
        )

    def _everywhere(self, call: Call):
        """`call` here first (what it returns is process 0's), then on every follower."""
        result = call.run(self.runner)
        self.sender.call(call)
        return result

    def shutdown(self) -> None:
        """Release the followers: they leave their step loop."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def step_port(parallel: ParallelConfig) -> int:
    """The step channel's port: the one after the jax.distributed coordinator's."""
    return parallel.master_port + 1


def follow(runner: ModelRunner, parallel: ParallelConfig) -> None:
    """A process of node_rank > 0: run each step process 0 sends, until it stops."""
    receiver = StepReceiver(parallel.master_addr, step_port(parallel), parallel.node_rank)
    logger.info("process %d: following process 0's steps", parallel.node_rank)
    is_pipelined = parallel.pipeline_parallel_size > 1
    try:
        while (inputs := receiver.recv()) is not None:
            if isinstance(inputs, Call):
                receiver.answer_call(_run_call(inputs, runner))
                continue
            host = runner.run(inputs)
            if is_pipelined:  # the last stage's process sampled; the others ran their stages only
                receiver.send_outputs(host)
            else:
                receiver.report(host["token_ids"])
    finally:
        receiver.close()


def _run_call(call: Call, runner: ModelRunner) -> str | None:
    """Run a research-stack call on this process's shards: None, or what failed."""
    try:
        call.run(runner)
    except Exception as e:  # answered to process 0, which stops the engine with it
        logger.exception("process %d: %s failed", jax.process_index(), call.method)
        return f"{type(e).__name__}: {e}"
    return None

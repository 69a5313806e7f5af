"""The engine core in its own process: a busy loop around `EngineCore.step()` between two ZMQ sockets.

Each turn: take every queued message (new requests, aborts, utility calls), run one step if any
request is unfinished, and send that step's outputs with the scheduler's gauges. With nothing to
do it blocks on the input socket, so an idle server burns no CPU. The front end (AsyncLLM) spawns
this process with `multiprocessing`'s spawn context, watches it, and stops it with `Shutdown`
(or SIGTERM); the process also dies with its parent, so it is never left orphaned.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time

import zmq

from xlaserve.config import EngineConfig
from xlaserve.engine.protocol import (
    UTILITY_METHODS,
    AbortRequests,
    AddRequests,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    Shutdown,
    UtilityCall,
    UtilityResult,
    make_encoder,
    make_input_decoder,
)

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how long an idle loop blocks before it looks again (parent checks are separate)
_PARENT_CHECK_S = 0.5
_PR_SET_PDEATHSIG = 1


class _ShutdownRequested(Exception):
    pass


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the front end dies, even by SIGKILL: PDEATHSIG on Linux, and a watcher thread."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watcher alone
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(_PARENT_CHECK_S)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _use_thread_lock_for_tqdm() -> None:
    # tqdm's default lock is a multiprocessing semaphore, which the resource tracker reports as
    # leaked whenever this process is killed; a thread lock is all one process needs.
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


def _on_sigterm(signum, frame):
    raise _ShutdownRequested()


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int,
    log_level: str = "INFO",
) -> None:
    """Entry point of the spawned process. `config` is the front end's, pickled whole: its
    environment-derived defaults (compilation cache, attention backend) were read there."""
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(
        level=log_level.upper(), format="%(levelname)s %(name)s (engine core): %(message)s", stream=sys.stderr
    )
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    _use_thread_lock_for_tqdm()
    # What lives as long as the process (the modules imported so far; after start-up the model, its
    # programs and caches) is moved out of the cyclic collector's reach, so its full collections scan
    # only what start-up and then the serving loop allocate (as vLLM's engine core does).
    gc.freeze()
    proc = None
    try:
        proc = EngineCoreProc(config, input_address, output_address)
        gc.collect()
        gc.freeze()
        proc.run_busy_loop()
    except _ShutdownRequested:
        logger.info("engine core: shutting down")
    except Exception as e:  # a bug or a device failure: tell the front end why, then exit non-zero
        logger.exception("engine core failed")
        if proc is not None:
            proc.send_dead(f"{type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        if proc is not None:
            proc.close()


class EngineCoreProc:
    """Owns an EngineCore and the core's ends of the two sockets."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str):
        self._zmq = zmq.Context()
        self._output = self._zmq.socket(zmq.PUSH)
        self._output.connect(output_address)
        self._input = self._zmq.socket(zmq.PULL)
        self._input.connect(input_address)
        self._encoder = make_encoder()
        self._decoder = make_input_decoder()
        self._is_shutdown = False
        self._rejected: list[tuple[str, str]] = []
        self.core, ready = _build_engine_core(config)
        self._send(ready)

    def run_busy_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._input, zmq.POLLIN)
        while not self._is_shutdown:
            timeout = 0 if self._has_steps() else _IDLE_POLL_MS
            has_news = False
            if poller.poll(timeout):
                has_news = self._process_input()
            if self._is_shutdown:
                break
            if self._has_steps():
                outputs = self.core.step()
                self._send_outputs(outputs)
            elif has_news:  # e.g. an abort freed blocks: the gauges must say so even when idle
                self._send_outputs(self.core.take_outputs())

    def _has_steps(self) -> bool:
        """Whether a step would run requests (those a sleep kept wait for wake_up)."""
        return self.core.has_unfinished_requests() and not self.core.is_sleeping

    def _process_input(self) -> bool:
        """Handle every queued message; returns whether any arrived."""
        has_news = False
        while True:
            try:
                frame = self._input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return has_news
            has_news = True
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, AddRequests):
                for wire_request in message.requests:
                    try:
                        self.core.add_request(wire_request.to_request())
                    except ValueError as e:
                        self._rejected.append((wire_request.request_id, str(e)))
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            elif isinstance(message, UtilityCall):
                self._call_utility(message)
            elif isinstance(message, Shutdown):
                self._is_shutdown = True
                return has_news

    def _call_utility(self, call: UtilityCall) -> None:
        if call.method not in UTILITY_METHODS:
            self._send(UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}"))
            return
        try:
            target = getattr(self.core, call.method)
            result = target(*call.args) if callable(target) else target
        except ValueError as e:  # the caller's error (bad arguments, a busy or sleeping engine)
            self._send(UtilityResult(call.call_id, error=str(e), invalid=True))
            return
        if dataclasses.is_dataclass(result):
            result = dataclasses.asdict(result)
        # What the call changed reaches the front end before its result: the outputs it made (a sleep's
        # aborts) and the stats after it (its sleep state), so its caller never reads the state before.
        self._send_outputs(self.core.take_outputs())
        self._send(UtilityResult(call.call_id, result=result))

    def _send_outputs(self, outputs) -> None:
        rejected, self._rejected = self._rejected, []
        self._send(EngineCoreOutputs(outputs, self.core.make_stats(), rejected))

    def _send(self, message) -> None:
        self._output.send(self._encoder.encode(message), copy=False)

    def send_dead(self, reason: str) -> None:
        try:
            self._output.send(self._encoder.encode(EngineDead(reason)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.core.shutdown()  # releases the other processes of a multi-host engine
        self._input.close(linger=0)
        self._output.close(linger=1000)  # let the last outputs (or the death notice) go out
        self._zmq.term()


def _build_engine_core(config: EngineConfig):
    """Load the checkpoint and build (and warm up) the engine core, exactly as `LLM` does in-process."""
    # Imported here, in the engine-core process only: the front end that imports this module to
    # spawn it never loads jax or the model code.
    from xlaserve.engine.startup import start_engine

    info, core = start_engine(config)
    ready = EngineReady(
        max_model_len=core.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_id=info.eos_token_id,
        block_size=config.cache.block_size,
        num_usable_blocks=core.kv_cache_manager.num_usable_blocks,
        weight_bytes=core.executor.weight_bytes,
        num_kv_blocks=core.executor.num_kv_blocks,
        pooling_task=info.pooling_task,
        hidden_size=info.hidden_size,
        id2label=list(info.id2label),
        is_matryoshka=info.is_matryoshka,
        matryoshka_dimensions=info.matryoshka_dimensions and list(info.matryoshka_dimensions),
    )
    lora_slots = core.executor.lora_slots()
    if lora_slots is not None:
        layout, layer_stacks = lora_slots
        ready.lora_layout = {s: {m: list(shape) for m, shape in ms.items()} for s, ms in layout.items()}
        ready.lora_layer_stacks = {s: list(layers) for s, layers in layer_stacks.items()}
    return core, ready

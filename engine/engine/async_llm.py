"""`AsyncLLM`: the online front end. Tokenizes, streams, aborts; the EngineCore runs in its own process.

```
generate() ─► InputProcessor (validate, seeds) ─ZMQ─► EngineCoreProc: step() in a busy loop
   ▲                                                        │
   └── per-request queue ◄── OutputProcessor (delta text) ◄─┘  one message per step
```
The same `OutputProcessor` as the offline `LLM` turns token ids into text; here it runs in the mode
a request asks (vLLM's `RequestOutputKind`: the `output_kind` argument, else SamplingParams.output_kind,
else "delta": each output holds only what is new). Everything runs on one asyncio loop; the only other
thread is the monitor that notices a dead core.

A dead core is supervised, not fatal (engine/supervisor.py): the requests it held fail at once, new
ones get EngineDeadError (503) while a new core starts, then serving resumes. A core that keeps dying
sets `failed`, and the server exits. What comes back from the core (the output loop, utility calls'
results) is engine/core_calls.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator

import numpy as np

from xlaserve.config import EngineConfig
from xlaserve.core.limits import RequestLimits
from xlaserve.engine.core_calls import CoreCalls
from xlaserve.engine.core_client import EngineCoreClient, EngineDeadError, cancel_quietly
from xlaserve.engine.metrics import EngineMetrics
from xlaserve.engine.output_processor import OutputProcessor
from xlaserve.engine.pooling_waiters import PoolingWaiters
from xlaserve.engine.processor import InputProcessor
from xlaserve.engine.protocol import AbortRequests, AddRequests, EngineCoreRequest
from xlaserve.engine.request_stream import (
    EngineShutdownError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from xlaserve.engine.supervisor import CoreSupervisor, EngineState, RestartPolicy
from xlaserve.lora_request import LoRARequest
from xlaserve.outputs import RequestOutput
from xlaserve.pooling_params import PoolingParams
from xlaserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineShutdownError",
    "EngineState",
    "InvalidRequestError",
    "QueueFullError",
    "RequestFailedError",
    "RequestStream",
]


class AsyncLLM(CoreCalls):
    """Generate asynchronously: `async for output in llm.generate(prompt, params, request_id): ...`.

    Build it with `await AsyncLLM.create(model, **engine_args)` inside a running event loop; call
    `shutdown()` when done. Keyword arguments are the offline `LLM`'s engine arguments, plus
    `max_num_queued_reqs`: at most max_num_seqs running and this many waiting requests are accepted;
    past that `generate` raises QueueFullError; and `max_engine_restarts`, `engine_restart_window`
    (seconds): the `RestartPolicy` for a core that dies.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        log_level: str = "INFO",
        max_engine_restarts: int = 2,
        engine_restart_window: float = 60.0,
        **engine_args,
    ):
        # Built once, here: bad arguments fail before anything is spawned, and each core process
        # (restarts included) receives this config as it is, environment-derived defaults and all.
        self._init(
            EngineConfig.from_kwargs(model, **engine_args),
            log_level,
            max_engine_restarts,
            engine_restart_window,
        )

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        log_level: str = "INFO",
        max_engine_restarts: int = 2,
        engine_restart_window: float = 60.0,
    ) -> AsyncLLM:
        """An AsyncLLM over an EngineConfig already built (the core is spawned; `start()` waits)."""
        self = cls.__new__(cls)
        self._init(config, log_level, max_engine_restarts, engine_restart_window)
        return self

    def _init(
        self, config: EngineConfig, log_level: str, max_engine_restarts: int, engine_restart_window: float
    ) -> None:
        self.config = config
        policy = RestartPolicy(max_engine_restarts, engine_restart_window)
        policy = policy.for_num_nodes(config.parallel.nnodes)  # a multi-host core is never restarted
        self.model = config.model.model
        self.tokenizer = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.block_size = self.config.cache.block_size
        self.num_usable_blocks = 0
        self.metrics = EngineMetrics()
        self._streams: dict[str, asyncio.Queue] = {}
        # runner="pooling": each pooling request's future, resolved with its pooled output (`encode`).
        self._pooling = PoolingWaiters()
        self.pooling_task: str | None = None  # the model's (embed, classify, reward); None: generate
        self.hidden_size = 0
        self.id2label: list[str] = []  # a classifier's label names by index (HTTP /classify's `label`)
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._is_asleep = False  # set by sleep() / wake_up(): a request meanwhile is refused here
        self._output_task: asyncio.Task | None = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.supervisor = CoreSupervisor(
            lambda: EngineCoreClient(config, log_level=log_level),
            policy,
            self.metrics,
            on_down=self._fail_in_flight,
            detach=lambda: cancel_quietly(self._output_task),
            on_ready=self._attach_core,
        )

    @classmethod
    async def create(cls, model: str | None = None, **kwargs) -> AsyncLLM:
        """Spawn the engine core, load the tokenizer meanwhile, and wait until the core is warm."""
        self = cls(model, **kwargs)
        await self.start()
        return self

    async def start(self) -> None:
        """Load the tokenizer and wait until the core (spawned by the constructor) is warm; on any
        failure or cancellation the core is stopped."""
        try:
            await self._start()
        except BaseException:
            self.core.shutdown(timeout=2.0)
            raise

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.config.model.skip_tokenizer_init:
            tokenizer = self.config.model.tokenizer or self.model
            trust_remote_code = self.config.model.trust_remote_code
            self.tokenizer = await loop.run_in_executor(None, _load_tokenizer, tokenizer, trust_remote_code)
        ready = await self.core.wait_ready()
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.num_usable_blocks = ready.num_usable_blocks
        self.lora_slots = (ready.lora_layout, ready.lora_layer_stacks)  # (None, None): LoRA off
        self.pooling_task, self.hidden_size = ready.pooling_task, ready.hidden_size
        self.id2label = ready.id2label
        self.metrics.record_engine(
            ready.weight_bytes, ready.num_kv_blocks, self.config.cache, ready.max_model_len
        )
        self.input_processor = InputProcessor.for_engine(
            self.config,
            self.tokenizer,
            ready,
            ready.max_model_len,
            RequestLimits(ready.max_model_len, self.block_size, ready.num_usable_blocks),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._attach_core()
        logger.info(
            "engine ready: max_model_len=%d, %d KV blocks of %d tokens",
            self.max_model_len,
            self.num_usable_blocks,
            self.block_size,
        )

    def _attach_core(self) -> None:
        """Read the (new) core's outputs; the supervisor watches its process."""
        self._output_task = asyncio.create_task(self._output_loop(self.core), name="engine-core-outputs")
        self.supervisor.watch_core()

    # -- state ---------------------------------------------------------------------------------

    @property
    def core(self) -> EngineCoreClient:
        return self.supervisor.core

    @property
    def state(self) -> EngineState:
        return self.supervisor.state

    @property
    def failed(self) -> asyncio.Event:
        """Set when the supervisor gives up on the core: the server exits."""
        return self.supervisor.failed

    @property
    def is_errored(self) -> bool:
        """Whether requests are refused now: the core is restarting, or gone for good."""
        return self.supervisor.errored_reason is not None

    def check_health(self) -> None:
        """Raise EngineDeadError (with a message fit for clients) unless the core is ready."""
        if self.supervisor.errored_reason is not None:
            raise EngineDeadError(self.supervisor.errored_reason)

    def get_num_unfinished_requests(self) -> int:
        """Core-level requests in flight (each of an n > 1 request's children counts)."""
        num_generating = (
            0 if self.output_processor is None else self.output_processor.get_num_unfinished_requests()
        )
        return num_generating + len(self._pooling)

    # -- requests ------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """InvalidRequestError (naming the field and the limit) if the request can never be served."""
        try:
            self.input_processor.validate_prompt(prompt_token_ids)
        except ValueError as e:
            raise InvalidRequestError(str(e), "prompt") from None
        try:
            self.input_processor.check_fits(len(prompt_token_ids), params.max_tokens)
        except ValueError as e:
            raise InvalidRequestError(str(e), "max_tokens") from None

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: str | RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs until it finishes, as `output_kind` says ("delta",
        "cumulative", "final" or vLLM's RequestOutputKind; None: `params.output_kind`, else "delta").

        Raises EngineDeadError or QueueFullError before anything is added, ValueError for a request
        that can never be served; closing the generator early aborts the request in the core.
        """
        stream = self.add_request(
            prompt_token_ids,
            params,
            request_id,
            prompt=prompt,
            priority=priority,
            cache_salt=cache_salt,
            output_kind=output_kind,
            lora_request=lora_request,
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()  # the caller stopped early, or failed: free the blocks

    def add_request(
        self,
        prompt_token_ids,
        params: SamplingParams,
        request_id: str,
        *,
        prompt=None,
        priority=0,
        cache_salt=None,
        output_kind: str | RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
        mm_features=(),
    ) -> RequestStream:
        """Add a request now (errors are raised here, synchronously) and return its output stream."""
        if self.config.model.runner != "generate":
            raise InvalidRequestError(
                f"this server runs runner={self.config.model.runner!r}: it embeds, classifies and scores "
                "(/v1/embeddings, /pooling, /classify, /score, /rerank); generating text needs "
                "runner='generate'",
                "model",
            )
        self._check_admission(request_id, params.n)
        self.validate(prompt_token_ids, params)
        if lora_request is not None and not self.config.lora.enable_lora:
            raise InvalidRequestError("LoRA adapters are not enabled on this server (--enable-lora)", "model")
        now = time.time()
        requests = self.input_processor.make_requests(
            request_id,
            prompt_token_ids,
            params,
            arrival_time=now,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
            mm_features=mm_features,  # a vision-language prompt's images (engine/engine/mm_processor.py)
        )
        mode = _output_mode(output_kind, params)
        self.output_processor.add_requests(request_id, requests, prompt, prompt_token_ids, now, mode)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            self.core.send(AddRequests([EngineCoreRequest.from_request(r) for r in requests]))
        except EngineDeadError:
            self._streams.pop(request_id, None)
            self.output_processor.abort_requests([request_id])
            raise
        return RequestStream(self, request_id, queue)

    def _check_admission(self, request_id: str, num_requests: int) -> None:
        self.check_health()
        if self._is_asleep:
            raise InvalidRequestError(
                "the engine is asleep (POST /sleep): POST /wake_up before sending requests"
            )
        if request_id in self._streams or request_id in self._pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        queued = self.config.scheduler.max_num_queued_reqs
        if queued is not None:
            limit = self.config.scheduler.max_num_seqs + queued
            if self.get_num_unfinished_requests() + num_requests > limit:
                raise QueueFullError(
                    f"the server is at capacity ({self.get_num_unfinished_requests()} requests in flight; "
                    f"max_num_seqs={self.config.scheduler.max_num_seqs} running plus "
                    f"max_num_queued_reqs={queued} waiting); retry later"
                )

    async def encode(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> np.ndarray:
        """A pooling request (runner="pooling"): its pooled output, float32, once its prompt is computed.
        InvalidRequestError names the field ("input" for the prompt); a caller that is cancelled (a
        client gone) aborts the request in the core."""
        self._check_admission(request_id, 1)
        try:
            self.input_processor.validate_prompt(prompt_token_ids)
            self.input_processor.check_fits(len(prompt_token_ids), 1)
        except ValueError as e:
            raise InvalidRequestError(str(e), "input") from None
        try:
            request = self.input_processor.make_pooling_request(
                request_id,
                prompt_token_ids,
                params,
                arrival_time=time.time(),
                priority=priority,
                cache_salt=cache_salt,
            )
        except ValueError as e:
            raise InvalidRequestError(str(e), str(e).split(" ", 1)[0]) from None
        future = self._pooling.add(request_id)
        try:
            self.core.send(AddRequests([EngineCoreRequest.from_request(request)]))
            return await future
        finally:
            if self._pooling.discard(request_id) and not self.is_errored:
                try:  # cancelled before its output came: free its blocks
                    self.core.send(AbortRequests([request_id]))
                except EngineDeadError:
                    pass

    def abort(self, request_id: str) -> None:
        """Stop a request (a parent id stops all its children) and free its KV blocks. A stream still
        being read ends with a final output whose finish_reason is "abort" (vLLM's), carrying what
        was generated since the previous output."""
        queue = self._streams.get(request_id)
        if queue is not None:
            for output in self.output_processor.abort_outputs(request_id):
                queue.put_nowait(output)
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        """abort() without the final output: the stream is about to end with an error instead."""
        self._streams.pop(request_id, None)
        core_ids = self.output_processor.abort_requests([request_id])
        if core_ids:
            self.metrics.record_abort()
            if not self.is_errored:
                try:
                    self.core.send(AbortRequests(core_ids))
                except EngineDeadError:
                    pass

    # -- shutdown ------------------------------------------------------------------------------

    def fail_all_requests(self, reason: str) -> None:
        """Abort every request in flight; each stream ends with EngineShutdownError(reason)."""
        self._pooling.fail(EngineShutdownError(reason))
        for request_id in list(self._streams):
            queue = self._streams[request_id]
            self._abort(request_id)
            queue.put_nowait(EngineShutdownError(reason))

    async def shutdown(self, timeout: float | None = None) -> None:
        """Fail what is still in flight, stop any restart, the output loop and the core process (given
        `timeout` seconds to stop by itself; None: as long as the engine's config needs,
        `EngineConfig.core_shutdown_timeout_s`)."""
        await self.supervisor.stop()  # a core that dies from here on is not restarted
        self.fail_all_requests("the server is shutting down")
        await cancel_quietly(self._output_task)
        if self.state is not EngineState.READY:
            timeout = 0.0  # a core that is starting (or dead) does not read a polite Shutdown: SIGTERM it
        self.core.shutdown(timeout)  # blocks this loop for at most ~timeout: nothing else runs by now


def _output_mode(output_kind: str | RequestOutputKind | None, params: SamplingParams) -> str:
    """The output processor's mode for a request: the caller's `output_kind` (the server's choice by
    `stream`), else the request's own (vLLM's AsyncLLM streams by SamplingParams.output_kind), else
    deltas, what AsyncLLM streamed before requests could say."""
    kind = output_kind if output_kind is not None else params.output_kind
    if kind is None:
        return "delta"
    return kind.mode if isinstance(kind, RequestOutputKind) else kind


def _load_tokenizer(model: str | None, trust_remote_code: bool):
    """The tokenizer, loaded in a thread while the engine core starts. Imported here: it pulls in
    transformers (no jax, no loader), which the front end need not import before it spawns the core."""
    from xlaserve.models.tokenizer import load_tokenizer

    return load_tokenizer(model, trust_remote_code=trust_remote_code)

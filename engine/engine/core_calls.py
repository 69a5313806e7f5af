"""What comes back from AsyncLLM's engine core: the output loop, and the utility calls it answers.

`CoreCalls` is the part of `AsyncLLM` (engine/async_llm.py), which builds on it, that reads the core
process's messages on one task: each step's outputs go to their requests' streams (or a pooling
request's future), a `UtilityResult` to the call awaiting it, and a core that reports its death (or an
output loop that fails) to the supervisor (engine/supervisor.py), which fails what is in flight
(`_fail_in_flight`). The utility calls are the core's methods called by name (`_call_utility`: the
research stack, profiling, the prefix cache's reset), vLLM's `call_utility_async`.
"""

from __future__ import annotations

import asyncio
import logging

from xlaserve.engine.core_client import EngineCoreClient, EngineDeadError
from xlaserve.engine.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineDead,
    SleepMode,
    UtilityCall,
    UtilityResult,
)
from xlaserve.engine.request_stream import RequestFailedError

logger = logging.getLogger(__name__)

# How often sleep(mode="wait") looks whether the requests in flight have finished.
_DRAIN_POLL_S = 0.01


class CoreCalls:
    """`AsyncLLM`'s output loop and utility calls (module doc)."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self._call_utility("reset_prefix_cache", reset_running_requests))

    # The research stack in the core process (LLM's calls of the same names; worker/weight_update.py).
    # A caller's error (a bad path, level or mode, already asleep) is a ValueError. The sleep state the
    # metrics show comes with the core's stats (SchedulerStats.sleep_level), like the offline LLM's.

    async def update_weights_from_path(self, path: str) -> list[str]:
        return await self._call_utility("update_weights_from_path", path)

    async def sleep(self, level: int = 1, mode: SleepMode = "abort") -> dict:
        """EngineCore.sleep; requests are refused from now on. With mode "wait" the requests in flight
        finish first (vLLM's), polled every `_DRAIN_POLL_S`."""
        was_asleep, self._is_asleep = self._is_asleep, True
        try:
            while mode == "wait" and self.get_num_unfinished_requests() and not was_asleep:
                await asyncio.sleep(_DRAIN_POLL_S)
            return await self._call_utility("sleep", level, mode)
        except BaseException:
            self._is_asleep = was_asleep
            raise

    async def wake_up(self) -> dict:
        report = await self._call_utility("wake_up")
        self._is_asleep = False
        return report

    async def is_sleeping(self) -> bool:
        return bool(await self._call_utility("is_sleeping"))

    async def start_profile(self) -> None:
        """A jax.profiler trace of the engine core's process (CompilationConfig.profiler_dir)."""
        await self._call_utility("start_profile")

    async def stop_profile(self) -> str:
        return await self._call_utility("stop_profile")

    async def _call_utility(self, method: str, *args):
        self.check_health()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self.core.send(UtilityCall(call_id, method, list(args)))
        return await future

    async def _output_loop(self, client: EngineCoreClient) -> None:
        try:
            await self._handle_outputs(client)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must fail requests loudly, not hang them
            logger.exception("the output loop failed")
            self.supervisor.core_died(client, f"the front end's output loop failed: {type(e).__name__}: {e}")

    async def _handle_outputs(self, client: EngineCoreClient) -> None:
        while True:
            message = await client.recv()
            if isinstance(message, EngineCoreOutputs):
                self._process_outputs(message)
            elif isinstance(message, UtilityResult):
                future = self._utility_calls.pop(message.call_id, None)
                if future is not None and not future.done():
                    if message.error:
                        error = ValueError if message.invalid else RuntimeError
                        future.set_exception(error(message.error))
                    else:
                        future.set_result(message.result)
            elif isinstance(message, EngineDead):
                self.supervisor.core_died(client, f"the engine core failed: {message.reason}")

    def _process_outputs(self, message: EngineCoreOutputs) -> None:
        outputs = message.outputs
        if self._pooling:
            outputs = [o for o in outputs if not self._pooling.resolve(o)]
        processed = self.output_processor.process_outputs(outputs)
        for output in processed.request_outputs:
            queue = self._streams.get(output.request_id)
            if queue is None:
                continue
            queue.put_nowait(output)
            if output.finished:
                del self._streams[output.request_id]
        if processed.reqs_to_abort:  # finished here by a stop string
            self.core.send(AbortRequests(processed.reqs_to_abort))
        for core_id, reason in message.rejected:
            error = RequestFailedError(f"the engine rejected the request: {reason}")
            if core_id in self._pooling:
                self._pooling.fail(error, [core_id])
            else:
                self._fail(core_id, error)
        stats = self.output_processor.drain_stats()
        self.metrics.record_iteration(stats)
        if message.scheduler_stats is not None:
            self.metrics.record_scheduler(message.scheduler_stats)

    def _fail(self, core_id: str, error: BaseException) -> None:
        state = self.output_processor.request_states.get(core_id)
        request_id = state.parent.request_id if state is not None and state.parent is not None else core_id
        queue = self._streams.get(request_id)
        self._abort(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        self._pooling.fail(error)
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._streams.clear()
        self.output_processor.abort_requests(list(self.output_processor.request_states))
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._utility_calls.clear()

"""The front end's pooling requests in flight (runner="pooling"): a future per request, resolved with
its pooled output when the core finishes it, failed with the engine's error otherwise."""

from __future__ import annotations

import asyncio

import numpy as np

from xlaserve.engine.request_stream import RequestFailedError


class PoolingWaiters:
    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._futures

    def add(self, request_id: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        return future

    def discard(self, request_id: str) -> bool:
        """Forget `request_id`; whether it was still waiting (its output had not come)."""
        return self._futures.pop(request_id, None) is not None

    def resolve(self, output) -> bool:
        """Hand a pooling request's output (an EngineCoreOutput) to its waiter; False for a generation
        request's."""
        future = self._futures.get(output.request_id)
        if future is None:
            return False
        if output.finish_reason is not None:
            del self._futures[output.request_id]
            if future.done():  # its caller was cancelled meanwhile
                return True
            if output.pooling_output is not None:
                future.set_result(np.asarray(output.pooling_output, np.float32))
            else:
                future.set_exception(
                    RequestFailedError(f"the pooling request finished with {output.finish_reason}")
                )
        return True

    def fail(self, error: BaseException, request_ids=None) -> None:
        """End the waiters of `request_ids` (all, by default) with `error`."""
        for request_id in list(self._futures) if request_ids is None else request_ids:
            future = self._futures.pop(request_id, None)
            if future is not None and not future.done():
                future.set_exception(error)

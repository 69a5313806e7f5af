"""What AsyncLLM hands its callers: one request's output stream, and the errors a request can end
with (the server maps each to its HTTP status)."""

from __future__ import annotations

import asyncio

from xlaserve.engine.core_client import EngineDeadError
from xlaserve.outputs import RequestOutput


class EngineShutdownError(EngineDeadError):
    """The server is stopping; requests still in flight after the grace period end with this."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_num_queued_reqs` allows (the server answers 503)."""


class InvalidRequestError(ValueError):
    """A request that can never be served; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """The engine could not finish a request (rejected by the core, or failed inside a step)."""


class RequestStream:
    """One request's outputs as an async iterator; `close()` aborts the request if it is unfinished.

    Whoever iterates must close it in a `finally` (a cancelled task would otherwise leave the
    request running in the core).
    """

    def __init__(self, engine, request_id: str, queue: asyncio.Queue):  # engine: the AsyncLLM
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.is_finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        self.is_finished = item.finished
        return item

    def close(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self.engine.abort(self.request_id)

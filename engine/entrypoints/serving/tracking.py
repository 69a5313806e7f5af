"""Two server-wide views of requests, each behind its vLLM flag: an X-Request-Id header on every
response (--enable-request-id-headers), and the count of generation and pooling requests in flight
that GET /load reports (--enable-server-load-tracking).

Both are plain ASGI middleware: a response's headers pass through them once, and a request counts until
the app has sent its last byte (a stream's [DONE]), not only until its headers.
"""

from __future__ import annotations

import uuid

from xlaserve.entrypoints.serving.guard import route_path
from xlaserve.entrypoints.serving.state import ServerState

REQUEST_ID_HEADER = b"x-request-id"
# The routes that run the model (vLLM's load_aware_call routes, with this server's names for them).
_LOAD_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
    }
)


class RequestIdMiddleware:
    """The request's X-Request-Id header echoed on its response, else the route's own, else a new id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                # A route's own id (the Responses API's: the body's request_id) stands when none was sent.
                own = [v for k, v in headers if k.lower() == REQUEST_ID_HEADER]
                request_id = sent or (own[0] if own else uuid.uuid4().hex.encode())
                headers = [(k, v) for k, v in headers if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class LoadTracker:
    """Counts the model-running requests in flight in `state.server_load`, from arrival to the end of
    the response, whatever status it ends with."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in _LOAD_PATHS:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1

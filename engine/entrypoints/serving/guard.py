"""What stands between a client and the routes: the API key (Bearer or x-api-key), a bound on the body
counted as it arrives, JSON decoding that can name a field holding invalid UTF-8, and a last resort for
unexpected errors.

No request, however malformed, gets a 5xx for its own fault or costs the client its keep-alive
connection, with two exceptions: a body over the bound is refused unread, so the connection has to
close (its unread rest cannot be told apart from the next request); and HTTP that h11 cannot parse
is answered by the protocol itself (see http11.py), which closes it too.
"""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.datastructures import Headers

from xlaserve.entrypoints.serving.errors import APIError, internal_error

logger = logging.getLogger("xlaserve.entrypoints.serving")

MAX_BODY_BYTES = 32 * 2**20
# The request line plus headers. h11 enforces it only on a head that arrives in pieces (a complete
# one read at once passes), so GuardMiddleware checks every request against it too.
MAX_HEADER_BYTES = 16 * 2**10
# The admin routes (serving/admin.py): served only with a key, and always behind it.
ADMIN_PATHS = ("/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/tokenizer_info", "/detokenize", "/invocations", *ADMIN_PATHS)


class _BodyTooLarge(Exception):
    """The body passed max_body_bytes; the rest of it is left unread."""


def route_path(scope) -> str:
    """The path the routes match: Starlette routes a path that still starts with the --root-path prefix
    (a whole segment) as the path without it, so every check by path strips it too (else /prefix/v1/...
    would skip the API key)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class GuardMiddleware:
    """API key check (constant-time) and the body bound before any route runs; any exception a route
    lets escape becomes a 500 in OpenAI's JSON on the same connection.

    The body is read here, in full, and replayed to the app: counting the bytes as they arrive bounds
    a chunked body as tightly as one with a Content-Length (which is checked before reading at all).
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        # OpenAI's clients send "Authorization: Bearer <key>", Anthropic's "x-api-key: <key>": either does.
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.expected_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._check_headers(scope)
        try:
            # After an error the body is still read (and dropped), so the connection stays usable.
            body = await self._read_body(scope, receive, keep=error is None)
        except _BodyTooLarge:
            # Refused unread, its rest would be taken for the next request: the connection must close.
            response = (error or _too_large(self.max_body_bytes)).to_json_response(
                route_path(scope), Headers(scope=scope)
            )
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        if body is None:
            return  # the client left before sending its body: nobody to answer
        if error is not None:
            return await error.to_json_response(route_path(scope), Headers(scope=scope))(scope, receive, send)
        await self._run(scope, _replay(body, receive), send)

    def _check_headers(self, scope) -> APIError | None:
        raw_headers = scope.get("headers") or []
        num_head_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        if num_head_bytes + sum(len(name) + len(value) for name, value in raw_headers) > MAX_HEADER_BYTES:
            return headers_too_large()
        headers = dict(raw_headers)
        if (
            self.expected is not None
            and route_path(scope).startswith(_PROTECTED_PREFIXES)
            and not self._is_authorized(headers)
        ):
            return APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )
        return None

    def _is_authorized(self, headers: dict[bytes, bytes]) -> bool:
        # Both compared in constant time, whichever is sent, so timing tells nothing about the key.
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
        return bearer or x_api_key

    async def _read_body(self, scope, receive, keep: bool) -> bytes | None:
        """The whole body (b"" when not `keep`), None if the client disconnected first; raises
        _BodyTooLarge as soon as the Content-Length, or the bytes received, pass the bound."""
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:  # h11 rejects non-numbers
            raise _BodyTooLarge
        chunks, num_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                raise _BodyTooLarge
            if keep and chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run(self, scope, receive, send) -> None:
        is_started = False

        async def send_tracked(message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:  # noqa: BLE001 - the last resort: log it, answer it, keep the connection
            logger.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not is_started:
                await internal_error().to_json_response(route_path(scope), Headers(scope=scope))(
                    scope, receive, send
                )
            # Otherwise the response is cut short and uvicorn closes the connection: a client must
            # not take half a response for a whole one.


def headers_too_large() -> APIError:
    return APIError(
        431,
        f"the request line and headers exceed the limit of {MAX_HEADER_BYTES} bytes",
        code="headers_too_large",
    )


def _too_large(max_body_bytes: int) -> APIError:
    return APIError(
        413, f"the request body exceeds the limit of {max_body_bytes} bytes", code="request_too_large"
    )


def _replay(body: bytes, receive):
    """A `receive` that hands the app the body read already, then the client's later messages
    (a disconnect)."""
    is_delivered = False

    async def replay():
        nonlocal is_delivered
        if is_delivered:
            return await receive()
        is_delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class JSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            # JSON is UTF-8 (RFC 8259). Bytes that are not become lone surrogates, which protocol.Text
            # reports with the name of the field holding them, rather than failing the whole body.
            text = (await self.body()).decode("utf-8", "surrogateescape")
            try:
                self._json = json.loads(text)
            except RecursionError:
                raise json.JSONDecodeError("arrays or objects nested too deeply", "", 0) from None
            except json.JSONDecodeError:
                raise
            except ValueError:  # the only other one: an integer of more than 4300 digits
                raise json.JSONDecodeError("a number has too many digits", "", 0) from None
        return self._json


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


class JSONRoute(APIRoute):
    """A route whose body must be JSON: another Content-Type is a 415 naming it (FastAPI would pass
    the raw bytes on, to fail as "not an object"), and the body is decoded by JSONRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        has_body = self.body_field is not None

        async def route_handler(request: Request):
            request = JSONRequest(request.scope, request.receive)
            content_type = request.headers.get("content-type")
            if has_body and await request.body() and not _is_json(content_type):
                shown = (content_type or "none")[:100]
                raise APIError(
                    415,
                    f"the request body must be JSON with 'Content-Type: application/json', got '{shown}'",
                    code="invalid_content_type",
                )
            return await handler(request)

        return route_handler

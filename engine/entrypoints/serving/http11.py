"""uvicorn's h11 protocol, answering malformed HTTP in OpenAI's error JSON instead of plain text.

h11 refuses what it cannot parse (a request head over guard.MAX_HEADER_BYTES, a bad
Content-Length, an illegal request line or header, a broken chunked encoding) before any ASGI app
runs, so the answer has to come from the protocol. The connection then closes, as in stock uvicorn:
once the framing is broken, nothing says where the next request would start.

The server always uses this class, never httptools (whose errors uvicorn answers without a hook), so
clients see the same answers wherever it is installed.
"""

from __future__ import annotations

import http
import json
import re
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from xlaserve.entrypoints.serving.errors import APIError
from xlaserve.entrypoints.serving.guard import headers_too_large

# h11's messages name the fault, then may quote the offending bytes ("illegal header line: b'...'").
_QUOTED_BYTES = re.compile(r":?\s*b['\"].*$", re.DOTALL)


def protocol_error(error: BaseException | None) -> APIError:
    """The client-facing error for an h11 RemoteProtocolError: its kind, never the bytes it quotes."""
    if getattr(error, "error_status_hint", 400) == 431:
        return headers_too_large()
    reason = _QUOTED_BYTES.sub("", str(error or "")).strip() or "unparseable request"
    return APIError(400, f"malformed HTTP request: {reason}", code="invalid_http")


class JSONErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()  # a response is already under way: cutting it short is all that is left
            return
        # uvicorn calls this inside its `except h11.RemoteProtocolError:`, so the error is at hand.
        error = protocol_error(sys.exc_info()[1])
        body = json.dumps(error.to_response().model_dump()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = http.HTTPStatus(error.status_code).phrase.encode()
        for event in (
            h11.Response(status_code=error.status_code, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

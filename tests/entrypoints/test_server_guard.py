"""The server's last resort, without an engine: a route that raises is answered with a 500 in OpenAI's
JSON that shows none of the exception, the log keeps it, and the keep-alive connection survives.
No input reaches this path in the real server (test_server_hostile.py), so a tiny app provokes it."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from xlaserve.entrypoints.serving.errors import install_error_handlers
from xlaserve.entrypoints.serving.guard import MAX_HEADER_BYTES, GuardMiddleware, JSONRoute
from xlaserve.entrypoints.serving.http11 import JSONErrorH11Protocol

SECRET = "internal detail of pid 4242"
START_TIMEOUT_S = 30


def _app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = JSONRoute
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=None)

    @app.post("/boom")
    async def boom(body: dict):
        raise RuntimeError(SECRET)

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    return app


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        _app(),
        host="127.0.0.1",
        port=port,
        http=JSONErrorH11Protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        lifespan="off",
        log_level="warning",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)  # off the main thread: no signal handlers
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(START_TIMEOUT_S)


def test_unexpected_error_is_a_500_that_keeps_the_connection(url, caplog):
    with httpx.Client(base_url=url, timeout=30) as client, caplog.at_level(logging.ERROR):
        response = client.post("/boom", json={"x": 1})
        port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
        assert response.status_code == 500 and "connection" not in response.headers
        error = response.json()["error"]
        assert error["code"] == "internal_error" and error["type"] == "internal_server_error"
        assert SECRET not in response.text and "RuntimeError" not in response.text
        after = client.get("/ok")
        assert after.status_code == 200
        assert after.extensions["network_stream"].get_extra_info("client_addr")[1] == port
    assert SECRET in caplog.text  # the log has what the client does not

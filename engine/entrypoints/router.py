"""`xlaserve router --prefill URL [...] --decode URL [...]`: one OpenAI-compatible front for
disaggregated prefill (README "Disaggregated prefill"; core/kv_transfer.py has the engines' side).

Each completion or chat request goes first to a prefill instance (a `kv_producer` server) with
max_tokens=1 and `kv_transfer_params: {"do_remote_decode": true}`: it runs the prompt and keeps its
K/V blocks. Its answer's `kv_transfer_params` say where they are; the request then goes, as the
client sent it plus those params, to a decode instance (a `kv_consumer`), which fetches the blocks,
computes only the last prompt token and streams the answer back through here.

Instances are picked round robin, or (`--policy least_loaded`) by the fewest requests this router has
in flight on each. An instance that refuses connections or answers 5xx is skipped for
`--retry-after` seconds and the request tried on the next one: with no prefill instance left it goes
to a decode instance alone (which computes the prompt itself), with no decode instance left it fails
with a 503 in OpenAI's error format. An error in the request itself (4xx) is the client's answer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("xlaserve.entrypoints.router")

POLICIES = ("round_robin", "least_loaded")


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    down_until: float = 0.0  # monotonic time before which it is skipped

    @property
    def is_up(self) -> bool:
        return time.monotonic() >= self.down_until


class _InstanceError(Exception):
    """An instance could not answer (connection refused, timeout, 5xx): try another."""


class Pool:
    """Instances of one role, in the order a request tries them."""

    def __init__(self, urls: list[str], policy: str):
        self.instances = [Instance(url.rstrip("/")) for url in urls]
        self.policy = policy
        self._turn = itertools.count()

    def order(self) -> list[Instance]:
        """Every instance, the one to try first first: those up before those down."""
        n = len(self.instances)
        if self.policy == "least_loaded":
            ranked = sorted(self.instances, key=lambda i: i.in_flight)
        else:
            start = next(self._turn) % n
            ranked = [self.instances[(start + k) % n] for k in range(n)]
        return [i for i in ranked if i.is_up] + [i for i in ranked if not i.is_up]


def _error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


class Router:
    def __init__(self, prefill: list[str], decode: list[str], policy: str = "round_robin", retry_after_s=5.0):
        if not decode:
            raise ValueError("router: at least one --decode URL is needed")
        if policy not in POLICIES:
            raise ValueError(f"router: --policy must be one of {POLICIES}, got {policy!r}")
        self.prefill = Pool(prefill, policy)
        self.decode = Pool(decode, policy)
        self.retry_after_s = retry_after_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.num_prefill_fallbacks = 0  # requests decoded without a prefill instance (none answered)

    def _down(self, instance: Instance, why: str) -> None:
        logger.warning(
            "router: %s is not answering (%s); skipped for %.0f s", instance.url, why, self.retry_after_s
        )
        instance.down_until = time.monotonic() + self.retry_after_s

    async def _post(self, instance: Instance, path: str, body: dict) -> httpx.Response:
        instance.in_flight += 1
        try:
            response = await self.client.post(instance.url + path, json=body)
        except httpx.HTTPError as e:
            self._down(instance, repr(e))
            raise _InstanceError from e
        finally:
            instance.in_flight -= 1
        if response.status_code >= 500:
            self._down(instance, f"HTTP {response.status_code}")
            raise _InstanceError
        return response

    async def _prefill(self, path: str, body: dict) -> dict | Response | None:
        """The prefill instance's kv_transfer_params; its error response for a bad request; None when
        no instance answered (the decode instance then computes the prompt)."""
        prefill_body = {
            k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")
        }
        prefill_body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        for instance in self.prefill.order():
            try:
                response = await self._post(instance, path, prefill_body)
            except _InstanceError:
                continue
            if response.status_code != 200:
                return Response(response.content, response.status_code, media_type="application/json")
            return response.json().get("kv_transfer_params")
        return None

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"the request body is not JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        params = None
        if self.prefill.instances and body.get("n", 1) == 1 and "kv_transfer_params" not in body:
            params = await self._prefill(path, body)
            if isinstance(params, Response):
                return params
            if params is None:
                self.num_prefill_fallbacks += 1
        decode_body = body if params is None else dict(body, kv_transfer_params=params)
        if body.get("stream"):
            return await self._stream(path, decode_body)
        for instance in self.decode.order():
            try:
                response = await self._post(instance, path, decode_body)
            except _InstanceError:
                continue
            return Response(response.content, response.status_code, media_type="application/json")
        return _error(503, "router: no decode instance is answering")

    async def _stream(self, path: str, body: dict) -> Response:
        for instance in self.decode.order():
            instance.in_flight += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", instance.url + path, json=body), stream=True
                )
            except httpx.HTTPError as e:
                instance.in_flight -= 1
                self._down(instance, repr(e))
                continue
            if upstream.status_code >= 500:
                instance.in_flight -= 1
                await upstream.aclose()
                self._down(instance, f"HTTP {upstream.status_code}")
                continue
            return StreamingResponse(
                self._relay(instance, upstream),
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
            )
        return _error(503, "router: no decode instance is answering")

    async def _relay(self, instance: Instance, upstream: httpx.Response):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the instance died mid-answer: the stream says so and ends
            self._down(instance, repr(e))
            error = {
                "error": {"message": "router: the decode instance stopped answering", "type": "server_error"}
            }
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            instance.in_flight -= 1
            await upstream.aclose()

    async def get(self, path: str) -> Response:
        for instance in self.decode.order():
            try:
                response = await self.client.get(instance.url + path)
            except httpx.HTTPError as e:
                self._down(instance, repr(e))
                continue
            return Response(
                response.content, response.status_code, media_type=response.headers.get("content-type")
            )
        return _error(503, "router: no decode instance is answering")


def build_app(router: Router):
    from fastapi import FastAPI  # not at import: `xlaserve --help` stays light

    @asynccontextmanager
    async def lifespan(app):
        yield
        await router.client.aclose()

    app = FastAPI(title="xlaserve router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        return await router.get("/v1/models")

    @app.get("/health")
    async def health():
        up = [i.url for i in router.decode.instances if i.is_up]
        return JSONResponse({"decode_up": up}, status_code=200 if up else 503)

    return app


def add_parser(sub) -> None:
    p = sub.add_parser(
        "router",
        help="an OpenAI-compatible front for disaggregated prefill: prefill instances, then decode instances",
    )
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a kv_producer server")
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", required=True, help="a kv_consumer server"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=POLICIES, default="round_robin")
    p.add_argument(
        "--retry-after", type=float, default=5.0, help="seconds an unanswering instance is skipped"
    )
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    router = Router(args.prefill, args.decode, args.policy, args.retry_after)
    logger.info("router on %s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0

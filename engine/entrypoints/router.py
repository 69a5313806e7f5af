"""`xlaserve router --prefill URL [...] --decode URL [...]`: one OpenAI- and Anthropic-compatible front
for disaggregated prefill (README "Disaggregated prefill"; core/kv_transfer.py has the engines' side).

Each completion, chat, Responses or Anthropic messages request goes first to a prefill instance (a
`kv_producer` server) asking for one token (max_tokens=1, the Responses API's max_output_tokens=1)
with `kv_transfer_params: {"do_remote_decode": true}`: it runs the prompt and keeps its K/V blocks.
Its answer's `kv_transfer_params` say where they are; the request then goes, as the client sent it
plus those params, to a decode instance (a `kv_consumer`), which fetches the blocks, computes only
the last prompt token and streams the answer back through here. Which requests skip the prefill leg,
and what it leaves out of the body, is router_apis.py; the Responses API's stored responses are
router_responses.py. An n > 1 request's prefill leg asks for one sample: its n samples on the decode
instance share the prompt's one fetch (engine/engine/kv_fetch.py).

The client's credentials (`Authorization`, Anthropic's `x-api-key`) go with every request the router
makes for it, both legs and the Responses follow-ups, so instances may run with `--api-key`: a key an
instance refuses is its 401, relayed as its other errors are. `--api-key` on the router itself checks
the key before anything is routed (as `xlaserve serve` does: serving/guard.py).

Instances are picked round robin, or (`--policy least_loaded`) by the fewest requests this router has
in flight on each. An instance that refuses connections or answers 5xx is skipped for
`--retry-after` seconds and the request tried on the next one: with no prefill instance left it goes
to a decode instance alone (which computes the prompt itself), with no decode instance left it fails
with a 503 in the API's error format. An error in the request itself (4xx) is the client's answer.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from xlaserve.entrypoints.router_apis import CHAT, COMPLETIONS, MESSAGES, Api, credentials, read_body
from xlaserve.entrypoints.router_responses import add_responses_routes

logger = logging.getLogger("xlaserve.entrypoints.router")

POLICIES = ("round_robin", "least_loaded")
Watch = Callable[["Instance", bytes], bool]  # sees an answer's bytes; True: seen enough


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

    async def _post(self, instance: Instance, path: str, body: dict, headers: dict) -> httpx.Response:
        instance.in_flight += 1
        try:
            response = await self.client.post(instance.url + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            self._down(instance, repr(e))
            raise _InstanceError from e
        finally:
            instance.in_flight -= 1
        if response.status_code >= 500:
            self._down(instance, f"HTTP {response.status_code}")
            raise _InstanceError
        return response

    async def _prefill(self, api: Api, body: dict, headers: dict) -> dict | Response | None:
        """The prefill instance's kv_transfer_params; its error response for a bad request (or a key it
        refuses); None when no instance answered (the decode instance then computes the prompt)."""
        prefill_body = api.prefill_body(body)
        for instance in self.prefill.order():
            try:
                response = await self._post(instance, api.path, prefill_body, headers)
            except _InstanceError:
                continue
            if response.status_code != 200:
                return Response(response.content, response.status_code, media_type="application/json")
            return response.json().get("kv_transfer_params")
        return None

    async def handle(self, api: Api, request: Request) -> Response:
        body = await read_body(api, request)
        return body if isinstance(body, Response) else await self.route(api, body, credentials(request))

    async def route(self, api: Api, body: dict, headers: dict, watch: Watch | None = None) -> Response:
        """The request's answer: the prefill leg (unless `api` says the request skips it), then the
        request with the prefill's kv_transfer_params on a decode instance, relayed; `headers` (the
        client's credentials) go with both."""
        params = None
        if self.prefill.instances and not api.skips_prefill(body):
            params = await self._prefill(api, body, headers)
            if isinstance(params, Response):
                return params
            if params is None:
                self.num_prefill_fallbacks += 1
        decode_body = body if params is None else dict(body, kv_transfer_params=params)
        return await self.send(api, "POST", api.path, decode_body, self.decode.order(), headers, watch)

    async def send(
        self,
        api: Api,
        method: str,
        path: str,
        body: dict | None,
        instances: list[Instance],
        headers: dict,
        watch: Watch | None = None,
        unavailable: str = "router: no decode instance is answering",
    ) -> Response:
        """The first of `instances` that answers, relayed: an event stream as it comes, anything else
        whole. `watch(instance, data)` sees a 200 answer's bytes (a stream's until it returns True)."""
        for instance in instances:
            instance.in_flight += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request(method, instance.url + path, json=body, headers=headers),
                    stream=True,
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
            watch = watch if upstream.status_code == 200 else None
            media_type = upstream.headers.get("content-type", "application/json")
            if media_type.startswith("text/event-stream"):
                return StreamingResponse(
                    self._relay(api, instance, upstream, watch), upstream.status_code, media_type=media_type
                )
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                self._down(instance, repr(e))
                continue
            finally:
                instance.in_flight -= 1
                await upstream.aclose()
            if watch is not None:
                watch(instance, content)
            return Response(content, upstream.status_code, media_type=media_type)
        return api.error(503, unavailable)

    async def _relay(self, api: Api, instance: Instance, upstream: httpx.Response, watch: Watch | None):
        try:
            async for chunk in upstream.aiter_raw():
                if watch is not None and watch(instance, chunk):
                    watch = None
                yield chunk
        except httpx.HTTPError as e:  # the instance died mid-answer: the stream says so and ends
            self._down(instance, repr(e))
            yield api.stream_error("router: the decode instance stopped answering")
        finally:
            instance.in_flight -= 1
            await upstream.aclose()


def build_app(router: Router, api_key: str | None = None):
    from fastapi import FastAPI  # not at import: `xlaserve --help` stays light

    from xlaserve.entrypoints.serving.guard import GuardMiddleware

    @asynccontextmanager
    async def lifespan(app):
        yield
        await router.client.aclose()

    app = FastAPI(title="xlaserve router", lifespan=lifespan)
    if api_key:  # the server's check: Bearer or x-api-key on /v1/, a 401 in the route's error shape
        app.add_middleware(GuardMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(COMPLETIONS, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(CHAT, request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await router.handle(MESSAGES, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The prompt's length: any instance counts it (a decode instance, as /v1/models)."""
        body = await read_body(MESSAGES, request)
        if isinstance(body, Response):
            return body
        path, instances = "/v1/messages/count_tokens", router.decode.order()
        return await router.send(MESSAGES, "POST", path, body, instances, credentials(request))

    add_responses_routes(app, router)

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.send(CHAT, "GET", "/v1/models", None, router.decode.order(), credentials(request))

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
    p.add_argument(
        "--api-key",
        default=os.environ.get("XLASERVE_API_KEY"),
        help="the key clients must send, Bearer or x-api-key (also XLASERVE_API_KEY); the client's "
        "credentials go on to the instances whether or not it is set",
    )
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    router = Router(args.prefill, args.decode, args.policy, args.retry_after)
    logger.info("router on %s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(build_app(router, args.api_key), host=args.host, port=args.port, log_level="warning")
    return 0

"""The Responses API through `xlaserve router` (entrypoints/router.py): POST /v1/responses, and the
follow-ups that read a stored response (GET /v1/responses/{id}, POST .../cancel, DELETE).

A stored response (`store`, the default), its conversation and a background response's run live on
the decode instance that answered it. So the router remembers which instance that was, reading the
id from its answer (a whole response, or a stream's `response.created` event), and sends the
response's follow-ups there: a request continuing it (`previous_response_id`), which takes no prefill
leg (its prompt is the history that instance holds, whose blocks its prefix cache holds too, where a
prefill instance would compute all of it again), and the GET, cancel and DELETE routes. The memory
is bounded (least recently used out); an id it does not hold (answered before this router started,
or by another router) is looked for on every decode instance with a GET, so a client gets what one
server would give: the response, or that server's 404.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response

from xlaserve.entrypoints.router_apis import RESPONSES, credentials, read_body

MAX_REMEMBERED = 1 << 16  # response ids whose decode instance the router remembers
_MAX_HEAD_BYTES = 1 << 16  # a stream's bytes read for its response.created event, at most


class ResponseOwners:
    """Response id -> the decode instance that holds it, the least recently used forgotten first."""

    def __init__(self, max_size: int = MAX_REMEMBERED):
        self.max_size = max_size
        self._owners: OrderedDict = OrderedDict()

    def get(self, response_id: str):
        instance = self._owners.get(response_id)
        if instance is not None:
            self._owners.move_to_end(response_id)
        return instance

    def remember(self, response_id: str, instance) -> None:
        self._owners[response_id] = instance
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.max_size:
            self._owners.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


class _IdReader:
    """A router Watch: remembers which instance answered a response, from its JSON or its stream's
    first event (response.created, or response.queued in the background)."""

    def __init__(self, owners: ResponseOwners):
        self.owners = owners
        self._head = b""

    def __call__(self, instance, data: bytes) -> bool:
        self._head += data
        if self._head.lstrip().startswith(b"{"):  # a whole response
            self._remember(instance, _json(self._head))
            return True
        while b"\n\n" in self._head:
            event, self._head = self._head.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    self._remember(instance, (_json(line[5:]) or {}).get("response"))
                    return True
        return len(self._head) > _MAX_HEAD_BYTES

    def _remember(self, instance, response) -> None:
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.owners.remember(response["id"], instance)


def _json(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return None


def add_responses_routes(app, router) -> None:
    """The Responses routes on the router's `app` (`router`: entrypoints/router.py's Router)."""
    owners = ResponseOwners()

    async def owner(response_id: str, headers: dict):
        """The decode instance holding the response (None: none that answers does, to the client's
        credentials `headers`)."""
        known = owners.get(response_id)
        if known is not None:
            return known
        for instance in router.decode.order():
            found = await router.send(RESPONSES, "GET", _path(response_id), None, [instance], headers)
            if found.status_code == 200:
                owners.remember(response_id, instance)
                return instance
        return None

    async def to_owner(
        request: Request, method: str, response_id: str, path: str, body: dict | None = None, watch=None
    ):
        """The request sent to the instance holding the response; to any when none does (it answers
        its 404, or its 401)."""
        headers = credentials(request)
        instance = await owner(response_id, headers)
        instances = [instance] if instance is not None else router.decode.order()
        why = f"router: the decode instance holding response {response_id[:64]!r} is not answering"
        return await router.send(RESPONSES, method, path, body, instances, headers, watch, unavailable=why)

    @app.post("/v1/responses")
    async def create(request: Request):
        body = await read_body(RESPONSES, request)
        if isinstance(body, Response):
            return body
        watch = _IdReader(owners) if body.get("store", True) is not False else None
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            return await to_owner(request, "POST", previous, "/v1/responses", body, watch)
        return await router.route(RESPONSES, body, credentials(request), watch)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        query = f"?{request.url.query}" if request.url.query else ""
        return await to_owner(request, "GET", response_id, _path(response_id) + query)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        return await to_owner(request, "POST", response_id, _path(response_id) + "/cancel")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        answer = await to_owner(request, "DELETE", response_id, _path(response_id))
        if answer.status_code == 200:
            owners.forget(response_id)
        return answer


def _path(response_id: str) -> str:
    return "/v1/responses/" + quote(response_id, safe="")

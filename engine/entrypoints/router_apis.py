"""What `xlaserve router` (entrypoints/router.py) knows of each API it fronts: which requests take the
prefill leg, the prefill leg's body, the client's credentials it sends on, and the router's own errors
in the API's shape.

The prefill leg asks for one token of the request's prompt, so it keeps every field that shapes the
prompt (messages, tools, instructions, template settings, the cache salt, the adapter) and leaves out
those that shape only the answer and could refuse a one-token answer (`n`, `min_tokens`, the stream's
options, the Responses API's logprobs `include`); a prefilled response is not stored. A request takes
no prefill leg when its prompt cannot be had there or its blocks would not be used: the client's own
`kv_transfer_params`, several prompts, a beam search (its own requests per step), prompt logprobs
(every prompt position computed), a Responses follow-up (`previous_response_id`: the history is on
the decode instance that answered it, which holds its blocks too), a background response (answered
at once, queued), and MCP tools or servers (several model turns, the tools listed on the server that
answers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

PREFILL_ONLY = {"do_remote_decode": True}
# Carried on to the instances: the credentials (OpenAI's Bearer, Anthropic's x-api-key) and Anthropic's
# version header, by which /v1/models answers in Anthropic's shape (entrypoints/app.py).
CREDENTIALS = ("authorization", "x-api-key", "anthropic-version")
_ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}


@dataclass(frozen=True)
class Api:
    path: str
    max_tokens_field: str  # the field the prefill leg sets to 1
    answer_only: tuple[str, ...]  # fields the prefill leg leaves out
    skips_prefill: Callable[[dict], bool]
    is_anthropic: bool = False
    prefill_fields: dict = field(default_factory=dict)  # set on the prefill leg besides the length

    def prefill_body(self, body: dict) -> dict:
        kept = {k: v for k, v in body.items() if k not in self.answer_only}
        return (
            kept
            | self.prefill_fields
            | {
                self.max_tokens_field: 1,
                "stream": False,
                "kv_transfer_params": PREFILL_ONLY,
            }
        )

    def error(self, status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
        """The router's own error (a body that is not JSON, no instance answering) in the API's shape."""
        if self.is_anthropic:
            kind = _ANTHROPIC_TYPES.get(status, "api_error")
            return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
        )

    def stream_error(self, message: str) -> bytes:
        """The event that ends a stream whose decode instance stopped answering mid-answer."""
        if self.is_anthropic:
            payload = {"type": "error", "error": {"type": "api_error", "message": message}}
            return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
        if self.path == "/v1/responses":
            payload = {"type": "error", "code": "server_error", "message": message, "param": None}
            return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
        return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n".encode()


def _is_several_prompts(prompt) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt)


def _skips_sampling(body: dict) -> bool:
    return (
        "kv_transfer_params" in body
        or bool(body.get("use_beam_search"))
        or body.get("prompt_logprobs") is not None
    )


def _skips_responses(body: dict) -> bool:
    tools = body.get("tools")
    has_mcp = isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") == "mcp" for t in tools)
    return (
        "kv_transfer_params" in body
        or body.get("previous_response_id") is not None
        or bool(body.get("background"))
        or has_mcp
    )


_SAMPLING_ANSWER_ONLY = ("stream", "stream_options", "max_completion_tokens", "n", "min_tokens")

COMPLETIONS = Api(
    "/v1/completions",
    "max_tokens",
    _SAMPLING_ANSWER_ONLY,
    lambda body: _skips_sampling(body) or _is_several_prompts(body.get("prompt")),
)
CHAT = Api("/v1/chat/completions", "max_tokens", _SAMPLING_ANSWER_ONLY, _skips_sampling)
RESPONSES = Api(
    "/v1/responses",
    "max_output_tokens",
    ("stream", "stream_options", "min_tokens", "include", "top_logprobs"),
    _skips_responses,
    prefill_fields={"store": False},
)
MESSAGES = Api(
    "/v1/messages",
    "max_tokens",
    ("stream",),
    lambda body: "kv_transfer_params" in body or bool(body.get("mcp_servers")),
    is_anthropic=True,
)


def credentials(request: Request) -> dict[str, str]:
    """The client's credential headers (OpenAI's Bearer, Anthropic's x-api-key and version), which every
    request the router makes for it carries on to the instances."""
    return {name: request.headers[name] for name in CREDENTIALS if name in request.headers}


async def read_body(api: Api, request: Request) -> dict | Response:
    """The request's JSON object, or the 400 (in the API's shape) that says it is none."""
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        return api.error(400, f"the request body is not JSON: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        return api.error(400, "the request body must be a JSON object", "invalid_request_error")
    return body

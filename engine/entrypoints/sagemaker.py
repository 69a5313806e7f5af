"""Amazon SageMaker's two routes, as vLLM serves them: `GET /ping` (the container's health check) and
`POST /invocations` (every inference request), so the server runs as a SageMaker container unchanged.

SageMaker sends each request to /invocations whatever it is; the body's shape picks the API, as in
vLLM's SageMaker entry point: a body with `messages` is a chat completions request, one with `prompt` a
completions request, answered exactly as /v1/chat/completions and /v1/completions answer it (streamed
too). Anything else is a 400 naming what was expected. Errors are OpenAI's JSON.
"""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from xlaserve.entrypoints.openai.chat import create_chat_completion
from xlaserve.entrypoints.openai.completions import create_completion
from xlaserve.entrypoints.openai.protocol import ChatCompletionResponse, CompletionRequest, CompletionResponse
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
from xlaserve.entrypoints.serving.engine_io import ENGINE_DEAD_MESSAGE
from xlaserve.entrypoints.serving.errors import APIError, bad_request
from xlaserve.entrypoints.serving.protocol import ErrorResponse, sse_or_json
from xlaserve.entrypoints.serving.state import ServerState

# The body's field that picks the API -> (the request model, its handler), tried in this order.
_ROUTES = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
)


def _validated(model: type[BaseModel], body: dict) -> BaseModel:
    """The body as `model`, its errors reported as a route's own (a 400 naming the field)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()])


def add_sagemaker_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.api_route("/ping", methods=["GET", "POST"], responses={503: {"model": ErrorResponse}})
    async def ping() -> dict[str, str]:
        """SageMaker's health check (open, like /health): 200 while the engine core serves, else 503."""
        if engine.is_errored:
            raise APIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead")
        return {"status": "ok"}

    @app.post(
        "/invocations",
        response_model=None,
        responses={
            **sse_or_json(ChatCompletionResponse | CompletionResponse),
            **{code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 415, 503)},
        },
    )
    async def invocations(raw_request: Request, body: dict[str, Any] = Body()):
        """A chat completions request (a body with `messages`) or a completions request (with `prompt`)."""
        for field, model, handler in _ROUTES:
            if field in body:
                return await handler(state, _validated(model, body), raw_request)
        raise bad_request(
            "the body of /invocations must be a chat completions request (with 'messages') or a "
            "completions request (with 'prompt')",
            code="invalid_body",
        )

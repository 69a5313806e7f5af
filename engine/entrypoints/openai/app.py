"""The FastAPI app: OpenAI's routes, Anthropic's /v1/messages, plus /tokenize, /detokenize, /health,
/version and /metrics."""

from __future__ import annotations

from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from xlaserve.entrypoints.anthropic.messages import add_routes as add_anthropic_routes
from xlaserve.entrypoints.openai.chat import apply_chat_template, create_chat_completion
from xlaserve.entrypoints.openai.completions import create_completion
from xlaserve.entrypoints.openai.errors import OpenAIError, bad_request, install_error_handlers
from xlaserve.entrypoints.openai.guard import GuardMiddleware, JSONRoute
from xlaserve.entrypoints.openai.lora import add_lora_routes
from xlaserve.entrypoints.openai.metrics import CONTENT_TYPE, make_registry, render
from xlaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from xlaserve.entrypoints.openai.serving import ENGINE_DEAD_MESSAGE, ServerState, check_model, tokenize_text


def _version() -> str:
    try:
        return metadata.version("xlaserve")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def _sse_or_json(model) -> dict:
    """200: JSON, or server-sent events when the request says `"stream": true`."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="xlaserve", version=_version(), summary="OpenAI-compatible LLM server on JAX/XLA")
    app.state.server = state
    app.router.route_class = JSONRoute
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=state.api_key)
    registry = make_registry(state.engine, state.model_name)
    engine = state.engine

    @app.get("/health", responses=_errors(503))
    async def health() -> dict[str, str]:
        """200 while the engine core serves; 503 while it is down or restarting, and once given up on."""
        if engine.is_errored:
            raise OpenAIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=_version())

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(render(registry), media_type=CONTENT_TYPE)

    def model_card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            created=state.started_at,
            root=engine.model or "smollm2",
            max_model_len=engine.max_model_len,
        )

    def lora_card(lora) -> ModelCard:
        return ModelCard(
            id=lora.lora_name,
            created=state.started_at,
            root=lora.lora_path,
            parent=lora.base_model_name or state.model_name,
            max_model_len=engine.max_model_len,
        )

    @app.get("/v1/models", responses=_errors(401))
    async def list_models() -> ModelList:
        adapters = [] if state.loras is None else [lora_card(lora) for lora in state.loras.all()]
        return ModelList(data=[model_card(name) for name in state.served_model_names] + adapters)

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def get_model(model_id: str) -> ModelCard:
        name = check_model(state, model_id)
        lora = state.lora_request(name)
        return model_card(name) if lora is None else lora_card(lora)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={**_sse_or_json(CompletionResponse), **_errors(400, 401, 404, 413, 415, 503)},
    )
    async def completions(request: CompletionRequest, raw_request: Request):
        return await create_completion(state, request, raw_request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={**_sse_or_json(ChatCompletionResponse), **_errors(400, 401, 404, 413, 415, 503)},
    )
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(state, request, raw_request)

    @app.post("/tokenize", responses=_errors(400, 401, 404, 413, 415))
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        check_model(state, request.model)
        if isinstance(request, TokenizeChatRequest):
            text = apply_chat_template(
                state,
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.tools,
                request.chat_template_kwargs,
            )
            param = "messages"
        else:
            text, param = request.prompt, "prompt"
        ids = tokenize_text(engine, text, request.add_special_tokens, param)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", responses=_errors(400, 401, 404, 413, 415))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, request.model)
        bad = [t for t in request.tokens if t >= engine.vocab_size]
        if bad:
            raise bad_request(f"tokens must be in [0, {engine.vocab_size}), got {bad[:4]}", "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))

    add_anthropic_routes(app, state)
    add_lora_routes(app, state.loras)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 responses: validation errors here are 400s."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema

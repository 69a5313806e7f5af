"""The server's FastAPI app: OpenAI's routes (openai/), Anthropic's /v1/messages (anthropic/),
SageMaker's /ping and /invocations (sagemaker.py), the LoRA adapter routes, the admin routes with
--enable-admin-api (serving/admin.py), the chat playground at / (playground.py), plus /health, /version
and /metrics.

This is the one module that knows both APIs: each API package imports only the shared serving code
(serving/), so either can change, or be left out, without touching the other.
"""

from __future__ import annotations

from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from xlaserve.entrypoints.anthropic.messages import add_routes as add_anthropic_routes
from xlaserve.entrypoints.anthropic.models import ModelInfo, ModelsPage, model_info, models_page
from xlaserve.entrypoints.anthropic.protocol import ANTHROPIC_TAGS
from xlaserve.entrypoints.openai.pooling import add_pooling_routes
from xlaserve.entrypoints.openai.protocol import UNION_TAGS as OPENAI_TAGS
from xlaserve.entrypoints.openai.protocol import ModelCard, ModelList, VersionResponse
from xlaserve.entrypoints.openai.responses_protocol import RESPONSES_TAGS
from xlaserve.entrypoints.openai.routes import add_routes as add_openai_routes
from xlaserve.entrypoints.openai.routes import model_card, model_list
from xlaserve.entrypoints.playground import add_playground_route
from xlaserve.entrypoints.sagemaker import add_sagemaker_routes
from xlaserve.entrypoints.serving.admin import add_admin_routes, add_profiler_routes
from xlaserve.entrypoints.serving.chat_protocol import UNION_TAGS as CHAT_TAGS
from xlaserve.entrypoints.serving.engine_io import ENGINE_DEAD_MESSAGE
from xlaserve.entrypoints.serving.errors import ANTHROPIC_VERSION_HEADER, APIError, install_error_handlers
from xlaserve.entrypoints.serving.guard import GuardMiddleware, JSONRoute
from xlaserve.entrypoints.serving.lora import add_lora_routes
from xlaserve.entrypoints.serving.metrics import CONTENT_TYPE, make_registry, render
from xlaserve.entrypoints.serving.protocol import ErrorResponse
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.entrypoints.serving.tracking import LoadTracker, RequestIdMiddleware

# Every discriminated union's tags in the app's request models: error locations leave them out.
UNION_TAGS = CHAT_TAGS | OPENAI_TAGS | RESPONSES_TAGS | ANTHROPIC_TAGS


# The requests' logprob counts (chat and Responses: top_logprobs; completions: logprobs; vLLM's
# prompt_logprobs): checked against the engine's max_logprobs per request (check_num_logprobs).
_LOGPROB_COUNTS = ("logprobs", "top_logprobs", "prompt_logprobs")


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def server_version() -> str:
    try:
        return metadata.version("xlaserve")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def build_app(state: ServerState) -> FastAPI:
    docs = {} if state.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="xlaserve",
        version=server_version(),
        summary="OpenAI-compatible LLM server on JAX/XLA",
        root_path=state.root_path or "",
        **docs,
    )
    app.state.server = state
    app.router.route_class = JSONRoute
    install_error_handlers(app, UNION_TAGS)
    if state.enable_server_load_tracking:  # inside the guard: a refused request never ran the model
        app.add_middleware(LoadTracker, state=state)
    app.add_middleware(GuardMiddleware, api_key=state.api_key)
    if state.cors is not None:  # outside the guard: a browser's preflight carries no API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.cors.allowed_origins,
            allow_methods=state.cors.allowed_methods,
            allow_headers=state.cors.allowed_headers,
            allow_credentials=state.cors.allow_credentials,
        )
    if state.enable_request_id_headers:  # outermost: the guard's and CORS's own answers carry it too
        app.add_middleware(RequestIdMiddleware)
    registry = make_registry(state.engine, state.model_name)
    engine = state.engine

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> dict[str, str]:
        """200 while the engine core serves; 503 while it is down or restarting, and once given up on."""
        if engine.is_errored:
            raise APIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=server_version())

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(render(registry), media_type=CONTENT_TYPE)

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the generation and pooling requests in flight (0 without --enable-server-load-tracking)."""
        return {"server_load": state.server_load}

    # One model route for both SDKs: Anthropic's (its anthropic-version header) reads its own shape
    # (anthropic/models.py); the schema states OpenAI's.
    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **_errors(401)})
    async def list_models(request: Request) -> ModelList | ModelsPage:
        if ANTHROPIC_VERSION_HEADER in request.headers:
            return models_page(state)
        return model_list(state)

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={200: {"model": ModelCard}, **_errors(401, 404)},
    )
    async def get_model(model_id: str, request: Request) -> ModelCard | ModelInfo:
        if ANTHROPIC_VERSION_HEADER in request.headers:
            return model_info(state, model_id)
        return model_card(state, model_id)

    add_openai_routes(app, state)
    add_pooling_routes(app, state)
    add_anthropic_routes(app, state)
    add_sagemaker_routes(app, state)
    add_lora_routes(app, state.loras)
    if state.enable_admin_api:
        add_admin_routes(app, state)
    if state.enable_profiler:
        add_profiler_routes(app, state)
    if state.enable_playground:
        add_playground_route(app)
    app.openapi = lambda: _openapi(app, engine.input_processor.max_logprobs)
    return app


def _openapi(app: FastAPI, max_logprobs: int) -> dict:
    """FastAPI's schema without its 422 responses (validation errors here are 400s), and with the
    logprob counts' bound, the engine's --max-logprobs (the models cannot state it: it is the engine's)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            routes=app.routes,
            servers=app.servers or None,  # FastAPI puts --root-path here before the first schema
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        models = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        for model in models.values():
            for name in _LOGPROB_COUNTS:
                field = model.get("properties", {}).get(name, {})
                for option in [field, *field.get("anyOf", ())]:
                    if option.get("type") == "integer":
                        option["maximum"] = max_logprobs
        app.openapi_schema = schema
    return app.openapi_schema

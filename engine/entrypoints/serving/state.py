"""What every route reads: the engine, the names it serves under, the chat template, the tool and
reasoning parsers the server was started with, and the LoRA adapters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.engine.media import MediaPolicy
from xlaserve.entrypoints.serving.errors import APIError
from xlaserve.entrypoints.serving.lora import LoRARegistry
from xlaserve.entrypoints.serving.reasoning import ReasoningParser
from xlaserve.entrypoints.serving.tool_parsers import ToolParser
from xlaserve.lora_request import LoRARequest


@dataclass(frozen=True)
class CORS:
    """Which web pages' scripts may call the server (vLLM's --allowed-origins and its fellows)."""

    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_names: list[str]
    chat_template: str | None = None
    # --trust-request-chat-template: a request's own `chat_template` is rendered (else a 400).
    trust_request_chat_template: bool = False
    # --chat-template-content-format: "string", "openai", or "auto" (chat_template.content_format).
    chat_template_content_format: str = "auto"
    log_requests: bool = True
    max_log_len: int | None = None  # --max-log-len: a prompt's characters and ids a request's log shows
    api_key: str | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser (instantiated per choice)
    enable_auto_tool_choice: bool = False
    tool_parser_cls: type[ToolParser] | None = None
    reasoning_parser_cls: type[ReasoningParser] | None = None
    loras: LoRARegistry | None = None  # with --enable-lora: the adapters, by name
    enable_admin_api: bool = False  # --enable-admin-api (with --api-key): serving/admin.py's routes
    enable_profiler: bool = False  # --profiler-dir given: POST /start_profile, /stop_profile
    max_stored_responses: int = 1000  # --max-stored-responses: the Responses API's LRU store
    enable_tokenizer_info_endpoint: bool = False  # --enable-tokenizer-info-endpoint: GET /tokenizer_info
    enable_playground: bool = True  # GET /: the chat page (off with --disable-playground)
    tool_servers: list[str] = field(default_factory=list)  # --tool-server: MCP servers' host:port
    # Where image and video parts' URLs may point (--allowed-local-media-path, --allowed-media-domains),
    # and a video's frames kept (--media-io-kwargs).
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)
    # What a request leaves out samples with: the model's generation config (--generation-config,
    # --override-generation-config; vLLM's default_sampling_params), else the engine's own defaults.
    default_sampling: dict = field(default_factory=dict)
    cors: CORS | None = None  # None: no page of another origin may read an answer
    enable_docs: bool = True  # /docs, /redoc, /openapi.json (off with --disable-fastapi-docs)
    root_path: str | None = None  # --root-path: the prefix a proxy serves the app under
    # --response-role: a chat completion's role when the request asks for a generation prompt.
    response_role: str = "assistant"
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_force_include_usage: bool = False  # a usage chunk ends every stream
    enable_request_id_headers: bool = False  # X-Request-Id on every response
    enable_server_load_tracking: bool = False  # GET /load counts the requests in flight
    server_load: int = 0  # the model-running requests in flight (serving/tracking.py's LoadTracker)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        return None if self.loras is None else self.loras.get(model)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def include_usage(self, stream_options) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk, and whether every chunk carries one (vLLM's rule:
        --enable-force-include-usage forces the first, never the second)."""
        if stream_options is None:
            return self.enable_force_include_usage, False
        include = stream_options.include_usage or self.enable_force_include_usage
        return include, include and bool(stream_options.continuous_usage_stats)


def check_model(state: ServerState, model: str | None) -> str:
    """The model name to report; 404 for a name this server does not serve."""
    if model is None or model in state.served_model_names:
        return state.model_name
    if state.loras is not None and model in state.loras:
        return model
    shown = model if len(model) <= 100 else model[:100] + "..."
    adapters = [] if state.loras is None else [lora.lora_name for lora in state.loras.all()][:16]
    raise APIError(
        404,
        f"The model '{shown}' does not exist; this server serves {state.served_model_names + adapters}",
        param="model",
        code="model_not_found",
    )

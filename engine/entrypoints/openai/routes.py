"""OpenAI's routes (and vLLM's beside them): /v1/completions, /v1/chat/completions, /tokenize and
/detokenize, /tokenizer_info (with --enable-tokenizer-info-endpoint), /v1/responses (responses.py), added
to the server's app (entrypoints/app.py), and the /v1/models answers that app.py routes."""

from __future__ import annotations

from fastapi import FastAPI, Request

from xlaserve.entrypoints.openai.chat import create_chat_completion
from xlaserve.entrypoints.openai.completions import create_completion
from xlaserve.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from xlaserve.entrypoints.openai.responses import add_responses_routes
from xlaserve.entrypoints.openai.tokenizer_info import TokenizerInfoResponse, tokenizer_info
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
from xlaserve.entrypoints.serving.chat_template import apply_chat_template
from xlaserve.entrypoints.serving.engine_io import require_tokenizer, tokenize_text
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.protocol import ErrorResponse, sse_or_json
from xlaserve.entrypoints.serving.state import ServerState, check_model


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def model_list(state: ServerState) -> ModelList:
    """GET /v1/models (app.py routes it: Anthropic's SDK gets its own shape there)."""
    adapters = [] if state.loras is None else [_lora_card(state, lora) for lora in state.loras.all()]
    return ModelList(data=[_model_card(state, name) for name in state.served_model_names] + adapters)


def model_card(state: ServerState, model_id: str) -> ModelCard:
    """GET /v1/models/{model_id}: a served name's card or a LoRA adapter's; 404 for any other."""
    name = check_model(state, model_id)
    lora = state.lora_request(name)
    return _model_card(state, name) if lora is None else _lora_card(state, lora)


def _model_card(state: ServerState, name: str) -> ModelCard:
    engine = state.engine
    return ModelCard(
        id=name, created=state.started_at, root=engine.model or "smollm2", max_model_len=engine.max_model_len
    )


def _lora_card(state: ServerState, lora) -> ModelCard:
    return ModelCard(
        id=lora.lora_name,
        created=state.started_at,
        root=lora.lora_path,
        parent=lora.base_model_name or state.model_name,
        max_model_len=state.engine.max_model_len,
    )


def add_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={**sse_or_json(CompletionResponse), **_errors(400, 401, 404, 413, 415, 503)},
    )
    async def completions(request: CompletionRequest, raw_request: Request):
        return await create_completion(state, request, raw_request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={**sse_or_json(ChatCompletionResponse), **_errors(400, 401, 404, 413, 415, 503)},
    )
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(state, request, raw_request)

    add_responses_routes(app, state)

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
                request.chat_template,
            )
            param = "messages"
        else:
            text, param = request.prompt, "prompt"
        ids = tokenize_text(engine, text, request.add_special_tokens, param)
        # The vocabulary's strings (a byte-level tokenizer's "Ġ" and all), not decoded text, as vLLM's.
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize", responses=_errors(400, 401, 404, 413, 415))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, request.model)
        bad = [t for t in request.tokens if t >= engine.vocab_size]
        if bad:
            raise bad_request(f"tokens must be in [0, {engine.vocab_size}), got {bad[:4]}", "tokens")
        tokenizer = require_tokenizer(engine, "/detokenize", "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    if state.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info", responses=_errors(400, 401))
        async def get_tokenizer_info() -> TokenizerInfoResponse:
            """The tokenizer's configuration and chat template (vLLM's; lm-eval tokenizes with it)."""
            tokenizer = require_tokenizer(engine, "/tokenizer_info", None)
            return TokenizerInfoResponse(**tokenizer_info(tokenizer, state.chat_template))

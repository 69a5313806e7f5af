"""POST /v1/chat/completions: messages through the chat template, n choices, streamed or not."""

from __future__ import annotations

import dataclasses
import logging
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.openai.logprobs import prompt_logprobs, token_logprobs
from xlaserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from xlaserve.entrypoints.openai.sse import SSE_DONE, sse_error, sse_event
from xlaserve.entrypoints.openai.tool_protocol import (
    DeltaFunctionCallOut,
    DeltaToolCallOut,
    FunctionCallOut,
    ToolCallOut,
)
from xlaserve.entrypoints.serving.beam_search import BeamSearchStream, beam_search_params
from xlaserve.entrypoints.serving.chat_parsing import ChoiceDelta, ChoiceParser
from xlaserve.entrypoints.serving.chat_path import chat_sampling_params, choice_parser
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
from xlaserve.entrypoints.serving.chat_template import render_chat
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    check_finish,
    collect_final,
    default_max_tokens,
    engine_error,
    merge_streams,
    request_ids,
    resolve_num_logprobs,
    submit,
    tokenize_text,
    truncated,
)
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.multimodal import (
    check_mm_processor_kwargs,
    image_parts,
    load_media,
    media_uuids,
    process_images,
    video_parts,
)
from xlaserve.entrypoints.serving.state import ServerState, check_model
from xlaserve.entrypoints.serving.tools import plan_tools

logger = logging.getLogger("xlaserve.entrypoints.openai")


def _logprobs(state: ServerState, completion, top_n: int | None, as_ids: bool) -> ChatLogprobs | None:
    """The chat choice's `logprobs` (None: not asked for)."""
    if top_n is None:
        return None
    return ChatLogprobs(content=token_logprobs(state, completion, top_n, as_ids))


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    # A call cut off by max_tokens stays "length": the client should not run it.
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def _response_role(state: ServerState, req: ChatCompletionRequest) -> str:
    # vLLM's rule: without a generation prompt the model goes on with the last message, in its role.
    return state.response_role if req.add_generation_prompt else req.messages[-1].role


def _echoed(state: ServerState, req: ChatCompletionRequest) -> str:
    """What `echo` puts before each choice's content (vLLM's): the last message's text where the answer
    goes on with it (the message's role is the answer's, as with continue_final_message), else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != _response_role(state, req) or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content if part.type == "text")


def _tool_call_out(call) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=FunctionCallOut(name=call.function.name, arguments=call.function.arguments)
    )


def _delta_out(delta: ChoiceDelta) -> DeltaMessage:
    calls = [
        DeltaToolCallOut(
            index=c.index,
            id=c.id,
            type=c.type,
            function=DeltaFunctionCallOut(name=c.function.name, arguments=c.function.arguments),
        )
        for c in delta.tool_calls
    ]
    return DeltaMessage(content=delta.content, reasoning_content=delta.reasoning, tool_calls=calls or None)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw_request: Request):
    model = check_model(state, req.model)
    if req.top_logprobs not in (None, 0) and not req.logprobs:  # vLLM's: 0 asks for nothing more
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    resolve_num_logprobs(state.engine, req, "top_logprobs", "prompt_logprobs")
    plan = plan_tools(req, state.enable_auto_tool_choice)
    check_mm_processor_kwargs(state, req.mm_processor_kwargs)
    image_fields, video_fields = image_parts(req.messages), video_parts(req.messages)
    images, videos = await load_media(state, image_fields, video_fields)
    text = render_chat(state, req)
    mm_features = []
    if images or videos:
        fields = [field for field, _ in video_fields]
        named = {"image_fields": [field for field, _ in image_fields], "uuids": media_uuids(req.messages)}
        ids, mm_features = await process_images(
            state, text, images, videos, fields, req.mm_processor_kwargs, **named
        )
    else:
        ids = tokenize_text(state.engine, text, False, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    cut = truncated(state.engine, ids, req.truncate_prompt_tokens, bool(mm_features), max_tokens)
    if cut is not ids:  # the rendered text is not the prompt's any more
        ids, text = cut, None
    check_context(state.engine, len(ids), max_tokens, "messages")
    max_tokens = default_max_tokens(state, max_tokens, len(ids))
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = chat_sampling_params(state, req, plan, ids, max_tokens)
    request_id, engine_id = request_ids(raw_request, "chatcmpl", req.request_id)
    kwargs = {"prompt": text, "priority": req.priority, "cache_salt": req.cache_salt}
    kwargs |= {"lora_request": state.lora_request(req.model), "mm_features": mm_features}
    if req.use_beam_search:
        room = state.engine.max_model_len - len(ids) if max_tokens is None else max_tokens
        forced = plan.structured_outputs is not None
        stream = BeamSearchStream(
            state,
            ids,
            beam_search_params(req, room, state.engine.input_processor.max_logprobs, forced_grammar=forced),
            engine_id,
            **kwargs,
        )
    else:
        stream = submit(state, ids, params, engine_id, stream=req.stream, **kwargs)
    created = int(time.time())
    parsers = [choice_parser(state, req, plan, ids) for _ in range(req.n)]
    if req.stream:
        return StreamingResponse(
            _stream(state, req, request_id, model, created, stream, ids, parsers),
            media_type="text/event-stream",
        )
    try:
        (output,) = await collect_final(raw_request, [stream])
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
        raise engine_error(e) from None
    check_finish(output)
    as_ids = req.return_tokens_as_token_ids
    choices = []
    echoed = _echoed(state, req)
    for c in output.outputs:
        parsed = parsers[c.index].parse(c.text)
        message = ChatResponseMessage(
            role=_response_role(state, req),
            content=echoed + (parsed.content or "") if echoed else parsed.content,
            reasoning_content=parsed.reasoning if req.include_reasoning else None,
            tool_calls=[_tool_call_out(call) for call in parsed.tool_calls],
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=_logprobs(state, c, top_n, as_ids),
                token_ids=list(c.token_ids) if req.return_token_ids else None,
                finish_reason=_finish_reason(c.finish_reason, len(parsed.tool_calls)),
                stop_reason=c.stop_reason,
            )
        )
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=UsageInfo.of(
            len(ids),
            num_generated,
            output.num_cached_tokens,
            state.enable_prompt_tokens_details,
            output.num_cache_creation_tokens,
        ),
        kv_transfer_params=output.kv_transfer_params,
        prompt_logprobs=prompt_logprobs(output.prompt_logprobs) if req.prompt_logprobs is not None else None,
        prompt_token_ids=list(output.prompt_token_ids) if req.return_token_ids else None,
    )


async def _stream(
    state: ServerState,
    req: ChatCompletionRequest,
    request_id: str,
    model: str,
    created: int,
    stream,
    prompt_ids: list[int],
    parsers: list[ChoiceParser],
):
    include_usage, continuous = state.include_usage(req.stream_options)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    as_ids = req.return_tokens_as_token_ids
    generated = [0] * req.n  # each choice's tokens so far
    num_cached = num_created = 0

    def chunk(choices, usage=None, prompt_token_ids=None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=request_id,
                created=created,
                model=model,
                choices=choices,
                usage=usage,
                prompt_token_ids=prompt_token_ids,
            )
        )

    def usage(num_generated: int) -> UsageInfo:
        """With continuous usage stats a chunk's is its choice's so far (vLLM's); the closing one is the
        request's."""
        return UsageInfo.of(
            len(prompt_ids), num_generated, num_cached, state.enable_prompt_tokens_details, num_created
        )

    merged = merge_streams([stream])
    try:
        for index in range(req.n):  # the first chunk carries the prompt's ids, when asked
            ids = prompt_ids if index == 0 and req.return_token_ids else None
            role = ChatChunkChoice(
                index=index, delta=DeltaMessage(role=_response_role(state, req), content="")
            )
            yield chunk([role], usage(0) if continuous else None, ids)
        if echoed := _echoed(state, req):
            for index in range(req.n):
                echo = ChatChunkChoice(index=index, delta=DeltaMessage(content=echoed))
                yield chunk([echo], usage(0) if continuous else None)
        async for _, output in merged:
            check_finish(output)
            num_cached, num_created = output.num_cached_tokens, output.num_cache_creation_tokens
            for c in output.outputs:
                generated[c.index] += len(c.token_ids)
                parser = parsers[c.index]
                delta = parser.feed(c.text) if c.text else ChoiceDelta()
                if c.finish_reason is not None:
                    last = parser.finish()
                    delta = ChoiceDelta(
                        _joined(delta.reasoning, last.reasoning),
                        _joined(delta.content, last.content),
                        delta.tool_calls + last.tool_calls,
                    )
                if not req.include_reasoning:
                    delta = dataclasses.replace(delta, reasoning=None)
                has_logprobs = top_n is not None and bool(c.token_ids)
                has_ids = req.return_token_ids and bool(c.token_ids)
                if not delta and c.finish_reason is None and not has_logprobs and not has_ids:
                    continue  # held back by a parser (a possible tag), or nothing new
                choice = ChatChunkChoice(
                    index=c.index,
                    delta=_delta_out(delta),
                    logprobs=_logprobs(state, c, top_n, as_ids) if has_logprobs else None,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                    finish_reason=_finish_reason(c.finish_reason, parser.num_calls_sent),
                    stop_reason=c.stop_reason,
                )
                yield chunk([choice], usage(generated[c.index]) if continuous else None)
        if include_usage:
            yield chunk([], usage(sum(generated)))
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        yield sse_error(e)
    finally:
        await merged.aclose()
    yield SSE_DONE


def _joined(a: str | None, b: str | None) -> str | None:
    return (a or "") + (b or "") or None

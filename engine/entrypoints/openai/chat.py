"""POST /v1/chat/completions: messages through the chat template, n choices, streamed or not."""

from __future__ import annotations

import logging
import time

from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from xlaserve.entrypoints.openai.errors import bad_request
from xlaserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from xlaserve.entrypoints.openai.serving import (
    MIN_LOGPROB,
    SSE_DONE,
    ServerState,
    check_context,
    check_finish,
    check_model,
    collect_final,
    engine_error,
    make_sampling_params,
    merge_streams,
    new_id,
    sse_error,
    sse_event,
    tokenize_text,
)
from xlaserve.outputs import CompletionOutput, Logprob

logger = logging.getLogger("xlaserve.entrypoints.openai")


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Pydantic messages -> the dicts a chat template reads (content parts joined into one string)."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # OpenAI's "developer" role is the newer name of "system"; templates know only the latter.
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


def apply_chat_template(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool
) -> str:
    tokenizer = state.engine.tokenizer
    if state.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "this model has no chat template; start the server with --chat-template", "messages"
        )
    if continue_final_message and (add_generation_prompt or messages[-1].role != "assistant"):
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's and "
            "add_generation_prompt=false",
            "continue_final_message",
        )
    try:
        return tokenizer.apply_chat_template(
            conversation(messages),
            chat_template=state.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except Exception as e:  # noqa: BLE001 - the template's raise_exception(), or a template bug
        if type(e) is TemplateError:  # raise_exception(message): the template's words, meant for users
            raise bad_request(f"the chat template rejects these messages: {e}", "messages") from None
        logger.warning("the chat template failed: %s: %s", type(e).__name__, e)
        raise bad_request("the chat template cannot render these messages", "messages") from None


def _chat_logprobs(state: ServerState, completion: CompletionOutput, top_n: int) -> ChatLogprobs:
    content = []
    entries: list[dict[int, Logprob]] = completion.logprobs or []
    for token_id, entry in zip(completion.token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        chosen = entry.get(token_id)
        token = _text(state, token_id, chosen)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=max(chosen.logprob if chosen is not None else MIN_LOGPROB, MIN_LOGPROB),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=(t := _text(state, tid, lp)),
                        logprob=max(lp.logprob, MIN_LOGPROB),
                        bytes=list(t.encode("utf-8")),
                    )
                    for tid, lp in ranked
                    if (lp.rank or 0) <= top_n
                ][:top_n],
            )
        )
    return ChatLogprobs(content=content)


def _text(state: ServerState, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return state.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _usage(num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw_request: Request):
    model = check_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    text = apply_chat_template(state, req.messages, req.add_generation_prompt, req.continue_final_message)
    ids = tokenize_text(state.engine, text, False, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    check_context(state.engine, len(ids), max_tokens, "messages")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = make_sampling_params(req, max_tokens, top_n)
    request_id = new_id("chatcmpl")
    try:
        stream = state.engine.add_request(
            ids,
            params,
            request_id,
            prompt=text,
            priority=req.priority,
            cache_salt=req.cache_salt,
            output_kind="delta" if req.stream else "final",
            lora_request=state.lora_request(req.model),
        )
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
        raise engine_error(e) from None
    if state.log_requests:
        logger.info("request %s: %d prompt tokens, %s", request_id, len(ids), params)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            _stream(state, req, request_id, model, created, stream, len(ids)), media_type="text/event-stream"
        )
    try:
        (output,) = await collect_final(raw_request, [stream])
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
        raise engine_error(e) from None
    check_finish(output)
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=_chat_logprobs(state, c, top_n) if top_n is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in output.outputs
    ]
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=_usage(len(ids), num_generated, output.num_cached_tokens),
    )


async def _stream(
    state: ServerState,
    req: ChatCompletionRequest,
    request_id: str,
    model: str,
    created: int,
    stream,
    num_prompt_tokens: int,
):
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    continuous = include_usage and req.stream_options.continuous_usage_stats
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    num_generated = num_cached = 0

    def chunk(choices, usage=None) -> str:
        return sse_event(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
        )

    merged = merge_streams([stream])
    try:
        for index in range(req.n):
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for _, output in merged:
            check_finish(output)
            num_cached = output.num_cached_tokens
            for c in output.outputs:
                num_generated += len(c.token_ids)
                if not c.text and c.finish_reason is None and not c.token_ids:
                    continue
                choice = ChatChunkChoice(
                    index=c.index,
                    delta=DeltaMessage(content=c.text),
                    logprobs=_chat_logprobs(state, c, top_n) if top_n is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                usage = _usage(num_prompt_tokens, num_generated, num_cached) if continuous else None
                yield chunk([choice], usage)
        if include_usage:
            yield chunk([], _usage(num_prompt_tokens, num_generated, num_cached))
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        yield sse_error(e)
    finally:
        await merged.aclose()
    yield SSE_DONE

"""POST /v1/completions: one or several prompts (text or token ids), n choices each, streamed or not."""

from __future__ import annotations

import logging
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs
from xlaserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from xlaserve.entrypoints.openai.sse import SSE_DONE, sse_error, sse_event
from xlaserve.entrypoints.serving.beam_search import BeamSearchStream, beam_search_params
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    check_finish,
    collect_final,
    default_max_tokens,
    engine_error,
    logged_prompt,
    make_sampling_params,
    merge_streams,
    request_ids,
    require_tokenizer,
    resolve_num_logprobs,
    tokenize_text,
    truncated,
)
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.state import ServerState, check_model
from xlaserve.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("xlaserve.entrypoints.openai")


def _prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, each cut to `truncate_prompt_tokens` (a cut prompt's text
    is None: echo decodes its ids)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    engine = state.engine
    out = []
    for item in items:
        if isinstance(item, str):
            text, ids = item, tokenize_text(engine, item, req.add_special_tokens, "prompt")
        else:
            text, ids = None, list(item)
        cut = truncated(engine, ids, req.truncate_prompt_tokens, max_tokens=req.max_tokens)
        out.append((text if cut is ids else None, cut))
    return out


def _prompt_text(state: ServerState, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return state.engine.tokenizer.decode(output.prompt_token_ids)


def _echoes_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the answer is the prompt alone (with its logprobs, as lm-eval's
    loglikelihood asks); the engine still samples one token, which the answer leaves out (vLLM's)."""
    return req.echo and req.max_tokens == 0


def _choice(
    state: ServerState,
    req: CompletionRequest,
    prompt_index: int,
    output: RequestOutput,
    completion: CompletionOutput,
    is_first: bool,
    text_offset: int = 0,
) -> CompletionChoice:
    """A choice (or a streamed chunk of one: `is_first` for its first, which echoes the prompt and
    carries the prompt's ids and logprobs when asked; `text_offset`: the length of the choice's text
    streamed before this chunk, where its logprobs' text offsets start)."""
    text, generated, entries = completion.text, list(completion.token_ids), list(completion.logprobs or [])
    if _echoes_only(req):
        text, generated, entries = "", [], []
    logprobs = None
    echo_prompt = req.echo and is_first
    prefix = _prompt_text(state, output) if echo_prompt else ""
    if req.logprobs is not None:
        token_ids = generated
        if echo_prompt:
            prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            token_ids, entries = output.prompt_token_ids + generated, list(prompt_entries) + entries
        logprobs = completion_logprobs(
            state, token_ids, entries, req.logprobs, text_offset, as_ids=req.return_tokens_as_token_ids
        )
    wants_prompt = is_first and req.prompt_logprobs is not None
    return CompletionChoice(
        index=prompt_index * req.n + completion.index,
        text=prefix + text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        prompt_logprobs=prompt_logprobs(output.prompt_logprobs) if wants_prompt else None,
        prompt_token_ids=list(output.prompt_token_ids) if is_first and req.return_token_ids else None,
        token_ids=generated if req.return_token_ids else None,
    )


async def create_completion(state: ServerState, req: CompletionRequest, raw_request: Request):
    model = check_model(state, req.model)
    if req.stream and req.use_beam_search:  # vLLM's refusal (chat streams a search's answer whole)
        raise bad_request("Streaming is not currently supported with beam search", "stream")
    # A prompt of token ids needs no tokenizer, but echo and logprobs answer with text.
    if req.echo:
        require_tokenizer(state.engine, "echo", "echo")
    if req.logprobs is not None:
        require_tokenizer(state.engine, "logprobs", "logprobs")
    resolve_num_logprobs(state.engine, req, "logprobs", "prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo: the prompt alone), got 0", "max_tokens"
        )
    prompts = _prompts(state, req)
    for _, ids in prompts:
        check_context(state.engine, len(ids), req.max_tokens, "prompt")
    if req.kv_transfer_params is not None and len(prompts) > 1:
        raise bad_request(
            f"kv_transfer_params needs a single prompt (the blocks of one), got {len(prompts)} prompts",
            "kv_transfer_params",
        )
    echoed_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    max_tokens = 1 if _echoes_only(req) else req.max_tokens
    if "max_tokens" not in req.model_fields_set and "max_tokens" in state.default_sampling:
        max_tokens = None  # the model's max_new_tokens, not OpenAI's default of 16
    params = [
        make_sampling_params(
            req,
            default_max_tokens(state, max_tokens, len(ids)),
            req.logprobs,
            echoed_logprobs,
            state.default_sampling,
        )
        for _, ids in prompts
    ]
    request_id, engine_id = request_ids(raw_request, "cmpl", req.request_id)
    streams = []
    try:
        for i, (text, ids) in enumerate(prompts):
            kwargs = {"prompt": text, "priority": req.priority, "cache_salt": req.cache_salt}
            kwargs["lora_request"] = state.lora_request(req.model)
            if req.use_beam_search:
                max_tokens = params[i].max_tokens
                room = state.engine.max_model_len - len(ids) if max_tokens is None else max_tokens
                search = beam_search_params(req, room, state.engine.input_processor.max_logprobs)
                streams.append(BeamSearchStream(state, ids, search, f"{engine_id}-{i}", **kwargs))
                continue
            output_kind = "delta" if req.stream else "final"
            streams.append(
                state.engine.add_request(
                    ids, params[i], f"{engine_id}-{i}", output_kind=output_kind, **kwargs
                )
            )
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
        for stream in streams:
            stream.close()
        raise engine_error(e) from None
    if state.log_requests:
        logger.info(
            "request %s: %d prompt(s), %s tokens, %s%s",
            engine_id,
            len(prompts),
            [len(ids) for _, ids in prompts],
            params,
            "".join(logged_prompt(state, ids) for _, ids in prompts),
        )
    created = int(time.time())
    num_prompt_tokens = sum(len(ids) for _, ids in prompts)
    if req.stream:
        return StreamingResponse(
            _stream(state, req, request_id, model, created, streams, [len(ids) for _, ids in prompts]),
            media_type="text/event-stream",
        )
    try:
        finals = await collect_final(raw_request, streams)
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
        raise engine_error(e) from None
    choices, num_generated, num_cached, num_created = [], 0, 0, 0
    for i, output in enumerate(finals):
        check_finish(output)
        num_cached += output.num_cached_tokens
        num_created += output.num_cache_creation_tokens
        for completion in output.outputs:
            choices.append(_choice(state, req, i, output, completion, True))
            num_generated += 0 if _echoes_only(req) else len(completion.token_ids)
    return CompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=UsageInfo.of(
            num_prompt_tokens, num_generated, num_cached, state.enable_prompt_tokens_details, num_created
        ),
        kv_transfer_params=finals[0].kv_transfer_params,
    )


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    request_id: str,
    model: str,
    created: int,
    streams,
    prompt_lengths: list[int],
):
    """Each choice's chunks; with continuous usage stats each chunk's usage is its choice's (its prompt's
    tokens and its own so far: vLLM's), the closing usage the whole request's."""
    include_usage, continuous = state.include_usage(req.stream_options)
    streamed: dict[tuple[int, int], int] = {}  # (prompt, choice) -> the length of its text so far
    generated: dict[tuple[int, int], int] = {}  # (prompt, choice) -> its tokens so far
    cached: dict[int, tuple[int, int]] = {}  # prompt -> its prefix-cache hit and the tokens it added

    def usage(num_prompt: int, num_generated: int, num_cached: int, num_created: int) -> UsageInfo:
        return UsageInfo.of(
            num_prompt, num_generated, num_cached, state.enable_prompt_tokens_details, num_created
        )

    merged = merge_streams(streams)
    try:
        async for i, output in merged:
            check_finish(output)
            cached[i] = (output.num_cached_tokens, output.num_cache_creation_tokens)
            for completion in output.outputs:
                key = (i, completion.index)
                num_new = 0 if _echoes_only(req) else len(completion.token_ids)
                generated[key] = generated.get(key, 0) + num_new
                choice = _choice(state, req, i, output, completion, key not in streamed, streamed.get(key, 0))
                streamed[key] = streamed.get(key, 0) + len(choice.text)
                if not choice.text and choice.finish_reason is None and not completion.token_ids:
                    continue
                chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[choice])
                if continuous:
                    chunk.usage = usage(prompt_lengths[i], generated[key], *cached[i])
                yield sse_event(chunk)
        if include_usage:
            yield sse_event(
                CompletionChunk(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    # the request's: every prompt's, summed as the one-shot answer's
                    usage=usage(
                        sum(prompt_lengths),
                        sum(generated.values()),
                        sum(hit for hit, _ in cached.values()),
                        sum(added for _, added in cached.values()),
                    ),
                )
            )
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        yield sse_error(e)
    finally:
        await merged.aclose()
    yield SSE_DONE

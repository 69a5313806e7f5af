"""A request's way into the engine and its outputs' way back, for every route of both APIs: request ->
SamplingParams, prompts -> token ids (with bounded work), the context check, engine errors -> HTTP
errors, merged streams and client-disconnect handling."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from fastapi import Request

from xlaserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineShutdownError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from xlaserve.entrypoints.serving.errors import APIError, bad_request, internal_error, param_of_value_error
from xlaserve.entrypoints.serving.protocol import SamplingFields
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.entrypoints.serving.structured_outputs import structured_outputs_of
from xlaserve.outputs import RequestOutput
from xlaserve.sampling_params import SamplingParams

T = TypeVar("T")

logger = logging.getLogger("xlaserve.entrypoints.serving")

# A token is rarely longer than this many characters; a prompt longer than max_model_len times this
# is only tokenized up to that point, enough to prove it cannot fit.
_MAX_CHARS_PER_TOKEN = 32
# A client's X-Request-Id as an id: bounded, so the engine's id (and a disaggregated prefill's
# remote_request_id, at most 256 characters) stays in its limits; printable, as it reaches logs.
MAX_REQUEST_ID_CHARS = 128
_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__) | set(SamplingFields.model_fields)
# Why the core died (its pid, exit code or signal) is for the log, which has it already.
ENGINE_DEAD_MESSAGE = "the engine is not available; the server must be restarted"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(raw_request: Request, prefix: str, sent_in_body: str | None = None) -> tuple[str, str]:
    """A request's id as its answer gives it, and the engine's id for it. The answer's id is the
    client's X-Request-Id header after `prefix-` where one is sent, else the body's `request_id`
    (vLLM's `_base_request_id` with the body's id as its default), else a new one. Two requests may send
    the same id, and the engine refuses an id in use: a client's id reaches the engine with 8 random hex
    digits more (as vLLM's `assign_request_id` adds)."""
    header = raw_request.headers.get("x-request-id")
    sent, field = (header, "X-Request-Id") if header is not None else (sent_in_body, "request_id")
    if sent is None:
        request_id = new_id(prefix)
        return request_id, request_id
    if not (0 < len(sent) <= MAX_REQUEST_ID_CHARS and sent.isascii() and sent.isprintable()):
        raise bad_request(
            f"{field} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters, got "
            f"{len(sent)} characters",
            field,
        )
    request_id = f"{prefix}-{sent}"
    return request_id, f"{request_id}-{uuid.uuid4().hex[:8]}"


def make_sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    defaults: Mapping[str, Any] = MappingProxyType({}),
) -> SamplingParams:
    """The request's SamplingParams; a field it leaves out takes `defaults`' value (the model's
    generation config: ServerState.default_sampling), else the engine's own. `max_tokens` is the route's
    (default_max_tokens)."""
    structured_outputs = structured_outputs_of(req)

    def pick(name: str, engine_default):
        value = getattr(req, name)
        return defaults.get(name, engine_default) if value is None else value

    if req.stream_options is not None and not req.stream:  # vLLM's and OpenAI's rule
        raise bad_request("stream_options can only be set when stream=true", "stream_options")
    if req.prompt_logprobs is not None:  # vLLM's field, beside what echo with logprobs needs
        if req.stream:
            raise bad_request("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        prompt_logprobs = max(req.prompt_logprobs, prompt_logprobs or 0)
    try:
        return SamplingParams(
            # A beam search's n is its width, not SamplingParams' children: greedy beams are allowed.
            n=1 if req.use_beam_search else req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
            logit_bias=_logit_bias(req),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            extra_args=_extra_args(req),
        )
    except ValueError as e:
        raise bad_request(str(e), param_of_value_error(e, _SAMPLING_FIELDS)) from None


def check_num_logprobs(engine: AsyncLLM, **counts: int | None) -> None:
    """The request's logprob counts, by their fields' names, against the engine's max_logprobs
    (--max-logprobs): past it, a 400 naming the field and the limit."""
    for name, value in counts.items():
        if value is None:
            continue
        try:
            engine.input_processor.check_num_logprobs(value, name)
        except ValueError as e:
            raise bad_request(str(e), name) from None


def resolve_num_logprobs(engine: AsyncLLM, req, *names: str) -> None:
    """Check the request's logprob counts (`names`, its fields) as check_num_logprobs does, then set
    vLLM's -1 to what it asks for, the vocabulary's size, so the route reads every count as a count."""
    check_num_logprobs(engine, **{name: getattr(req, name) for name in names})
    for name in names:
        if getattr(req, name) == -1:  # nothing else asks the engine (a route may refuse on after this)
            setattr(req, name, engine.input_processor.resolve_num_logprobs(-1))


def default_max_tokens(state: ServerState, max_tokens: int | None, num_prompt_tokens: int) -> int | None:
    """A request's max_tokens, or where it has none the model's generation config's (max_new_tokens)
    cut to the room the prompt leaves (vLLM's), else None: the rest of the context."""
    default = state.default_sampling.get("max_tokens")
    if max_tokens is not None or default is None:
        return max_tokens
    return max(1, min(default, state.engine.max_model_len - num_prompt_tokens))


def truncated(
    engine: AsyncLLM,
    ids: list[int],
    keep: int | None,
    has_images: bool = False,
    max_tokens: int | None = None,
    *,
    side: str | None = None,
) -> list[int]:
    """The prompt's last `keep` tokens, or its first where `side` is "right" (the request's
    truncate_prompt_tokens and truncation_side; InputProcessor.truncate: -1 leaves room for
    `max_tokens`), before its length is checked; a prompt with images that needs cutting, or a `keep`
    that cannot fit, is a 400 naming the field."""
    try:
        return engine.input_processor.truncate(ids, keep, has_images, max_tokens or 1, side=side or "left")
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None


def _logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) with int keys, each bias clamped to OpenAI's [-100, 100]
    as vLLM's SamplingParams.from_optional does; a key that is no token id is a 400."""
    if req.logit_bias is None:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not key.isascii() or not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids (digits), got {key!r}", "logit_bias")
        bias[int(key)] = min(100.0, max(-100.0, value))
    return bias


def _extra_args(req: SamplingFields) -> dict | None:
    if req.kv_transfer_params is None:
        return None
    return {"kv_transfer_params": req.kv_transfer_params.model_dump(exclude_none=True)}


def require_tokenizer(engine: AsyncLLM, what: str, param: str | None):
    """The engine's tokenizer; a 400 naming `what` when the server was started with
    --skip-tokenizer-init (vLLM's answer there), where the route would otherwise fail on None."""
    if engine.tokenizer is None:
        raise bad_request(
            f"{what} needs a tokenizer, and this server was started with --skip-tokenizer-init: "
            "send the prompt as token ids to /v1/completions",
            param,
        )
    return engine.tokenizer


def tokenize_text(engine: AsyncLLM, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Token ids of `text`; a huge text is cut before tokenizing once it surely exceeds the context."""
    tokenizer = require_tokenizer(engine, f"a text {param}", param)
    limit = engine.max_model_len * _MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        head = tokenizer.encode(text[:limit], add_special_tokens=add_special_tokens)
        if len(head) >= engine.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {engine.max_model_len} tokens, but the {param} has "
                f"more than {len(head)} tokens ({len(text)} characters); reduce the {param}",
                param,
                code="context_length_exceeded",
            )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_context(engine: AsyncLLM, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
    """400 naming both numbers when the prompt plus max_tokens exceed the context length."""
    limit = engine.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request(f"the {param} is empty (0 tokens)", param)
    wanted = num_prompt_tokens + (max_tokens or 1)
    if wanted > limit:
        blame = param if max_tokens is None or num_prompt_tokens >= limit else "max_tokens"
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
            f"({num_prompt_tokens} in the {param}, {max_tokens or 1} for the completion). "
            f"Please reduce the length of the {param} or the completion.",
            blame,
            code="context_length_exceeded",
        )


def engine_error(error: BaseException) -> APIError:
    """The HTTP error for an exception raised by AsyncLLM."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFullError):
        return APIError(503, str(error), code="queue_full")
    if isinstance(error, EngineShutdownError):
        return APIError(503, str(error), code="shutting_down")
    if isinstance(error, EngineDeadError):
        return APIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead")
    if isinstance(error, InvalidRequestError):
        return bad_request(str(error), error.param)
    if isinstance(error, RequestFailedError):
        # The core's reason is an exception's text from inside the engine: logged, not returned.
        logger.warning("request failed in the engine core: %s", error)
        return bad_request(
            "the engine rejected this request (the server log has the reason)", code="request_rejected"
        )
    if isinstance(error, ValueError):
        return bad_request(str(error), param_of_value_error(error, _SAMPLING_FIELDS))
    logger.error("request failed: %s: %s", type(error).__name__, error)
    return internal_error()


def submit(
    state: ServerState, ids: list[int], params: SamplingParams, request_id: str, *, stream: bool, **kwargs
) -> RequestStream:
    """One prompt into the engine (`kwargs`: AsyncLLM.add_request's prompt, priority, cache_salt,
    lora_request), its outputs as deltas when the route streams; an engine failure is an API error,
    and the request is logged unless --disable-log-requests."""
    try:
        request_stream = state.engine.add_request(
            ids, params, request_id, output_kind="delta" if stream else "final", **kwargs
        )
    except Exception as e:  # noqa: BLE001 - every failure becomes an API error
        raise engine_error(e) from None
    if state.log_requests:
        logger.info(
            "request %s: %d prompt tokens, %s%s", request_id, len(ids), params, logged_prompt(state, ids)
        )
    return request_stream


def logged_prompt(state: ServerState, ids: list[int]) -> str:
    """What a request's log line shows of its prompt: with --max-log-len N, its first N characters and
    first N token ids (vLLM's request log); without, nothing (the log is on by default here, off in
    vLLM, so a prompt reaches it only when asked for)."""
    if state.max_log_len is None:
        return ""
    n = state.max_log_len
    tokenizer = state.engine.tokenizer
    # The first n ids decode to at least n characters, but for tokens of no text.
    text = "" if tokenizer is None else tokenizer.decode(ids[:n])[:n]
    return f", prompt: {text!r}, prompt_token_ids: {list(ids[:n])}"


def check_finish(output: RequestOutput) -> None:
    """A request the engine failed (finish_reason "error") is the server's failure, not the client's."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            raise APIError(500, "the engine could not finish this request", code="engine_error")


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from several request streams as outputs arrive; leaving early
    (a disconnect, an error) aborts every stream still running."""
    try:
        if len(streams) == 1:
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for item in stream:
                    queue.put_nowait((i, item))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
    finally:
        for stream in streams:
            stream.close()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(streams) -> list[RequestOutput]:
    """The last output of each stream (a failure, or a cancellation, aborts every stream)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    merged = merge_streams(streams)
    try:
        async for i, output in merged:
            finals[i] = output
    finally:
        await merged.aclose()
    return finals


async def collect_final(raw_request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The last output of each stream; if the client goes away first, every stream is aborted."""
    return await until_disconnect(raw_request, final_outputs(streams))


async def until_disconnect(raw_request: Request | None, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, in a task of its own; if the client goes away first, the task is cancelled
    (what it runs aborts its requests) and the answer is a 499. No request (a background response's
    work): `work` itself, which its caller's cancellation stops."""
    if raw_request is None:
        return await work
    work = asyncio.create_task(work)
    disconnect = asyncio.create_task(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not work.done():
            work.cancel()  # the client left (or this handler was cancelled): abort the requests
    try:
        return await work
    except asyncio.CancelledError:
        raise APIError(499, "client disconnected") from None


async def drain(raw_request: Request | None, events: AsyncIterator) -> None:
    """Run `events` (an answer made as its events) to its end, a failure as the API error; the client
    leaving first aborts it (a 499: `until_disconnect`)."""

    async def run() -> None:
        try:
            async for _ in events:
                pass
        except Exception as e:  # noqa: BLE001 - every failure becomes an API error
            raise engine_error(e) from None

    await until_disconnect(raw_request, run())


async def run_ahead(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items` run in a task of its own, ahead of its reader. Returns once the first item is ready, so
    that what fails before it (a request found bad only after some work) raises here, before a stream's
    headers go out; a later failure raises from the iterator returned. Closing that iterator (the client
    left) cancels the task, and `items` is closed in the task that opened it."""
    queue: asyncio.Queue = asyncio.Queue()  # items, then `end` or the exception `items` raised
    end = object()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait((item, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((end, e))
            return
        queue.put_nowait((end, None))

    async def next_item():
        item, error = await queue.get()
        if error is not None:
            raise error
        return item

    task = asyncio.create_task(pump())
    try:
        first = await next_item()
    except BaseException:
        task.cancel()
        raise

    async def rest() -> AsyncIterator[T]:
        try:
            item = first
            while item is not end:
                yield item
                item = await next_item()
        finally:
            task.cancel()

    return rest()

"""OpenAI's server-sent events: each chunk a `data:` line of JSON, an error after the headers a final
event holding OpenAI's error JSON, then `data: [DONE]`."""

from __future__ import annotations

import json

from xlaserve.entrypoints.serving.engine_io import engine_error


def sse_event(payload) -> str:
    """One server-sent event holding a pydantic model or a dict as JSON."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


MIN_LOGPROB = -9999.0  # JSON has no -inf; a token the sampler could never pick gets this floor
SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: BaseException) -> str:
    """An error after the stream has started: a final event holding OpenAI's error JSON."""
    return sse_event(engine_error(error).to_response().model_dump())

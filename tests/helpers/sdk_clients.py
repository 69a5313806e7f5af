"""The official clients on a test server, strict: every answer and stream event validates against the
SDK's types, so a field the SDK requires and the server leaves out fails the test (a client otherwise
fills it with None). Completions are left out: OpenAI's own stream chunks (finish_reason null) and echoed
logprobs (null for the first token) do not fit the SDK's Completion type either."""

from __future__ import annotations

import anthropic
import openai


def strict_openai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key=server.api_key,
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )


def strict_anthropic(server) -> anthropic.Anthropic:
    """The key goes in x-api-key, as users set it up."""
    return anthropic.Anthropic(
        base_url=server.url,
        api_key=server.api_key,
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )


def anthropic_prompt_tokens(usage) -> int:
    """An Anthropic usage's whole prompt (what count_tokens counts): its buckets added up, the tokens
    neither read from nor written to the prefix cache (`input_tokens`), those read and those written. A
    usage object or its dict."""
    if not isinstance(usage, dict):
        usage = usage.model_dump()
    cached = ("cache_read_input_tokens", "cache_creation_input_tokens")
    return usage["input_tokens"] + sum(usage.get(key) or 0 for key in cached)

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
    computed (`input_tokens`) and those read from the prefix cache. A usage object or its dict."""
    if isinstance(usage, dict):
        return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)

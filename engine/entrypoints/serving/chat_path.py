"""What every route on the chat path (OpenAI's chat completions, the Responses API, Anthropic's
messages) makes per request from its tool plan: the SamplingParams and the parser of each choice's
text. One factory, so a forced tool choice behaves the same on every route.

A forced tool choice ("required", a named function; Anthropic's any and tool) puts a grammar on the
answer: it is a call list (or one call's arguments) and nothing else. Its choice parser is forced
too: no content, only the thinking and the calls, and the whole answer is the stream's own pieces put
together (a call cut by max_tokens keeps the arguments streamed so far), so a stream and a one-shot
answer always agree.
"""

from __future__ import annotations

import dataclasses

from xlaserve.entrypoints.serving.chat_parsing import ChoiceParser, make_tool_parser
from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
from xlaserve.entrypoints.serving.engine_io import make_sampling_params
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.reasoning import ReasoningParser
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.entrypoints.serving.tools import ToolPlan
from xlaserve.sampling_params import SamplingParams


def reasoning_parser(
    state: ServerState, req: ChatCompletionRequest, prompt_ids: list[int]
) -> ReasoningParser | None:
    """The server's --reasoning-parser for one choice (None without one). It sees the request's
    chat_template_kwargs, as vLLM's do: some families' thinking is a template switch (DeepSeek-V3.1's,
    Granite's `thinking`) that leaves no tag in the prompt to read."""
    if state.reasoning_parser_cls is None:
        return None
    return state.reasoning_parser_cls(
        state.engine.tokenizer, prompt_token_ids=prompt_ids, chat_template_kwargs=req.chat_template_kwargs
    )


def chat_sampling_params(
    state: ServerState,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    ids: list[int],
    max_tokens: int | None,
) -> SamplingParams:
    """The request's SamplingParams (what it leaves out: the server's defaults), with the grammar of its
    tool plan (or its own response_format), gated by the reasoning parser (structured output applies to
    the answer: it starts once the thinking has ended), and special tokens kept when the tool or
    reasoning parser's tags are special tokens.
    """
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = make_sampling_params(req, max_tokens, top_n, defaults=state.default_sampling)
    changes = {}
    spec = plan.structured_outputs or params.structured_outputs
    reasoning = reasoning_parser(state, req, ids)
    if spec is not None and reasoning is not None and not reasoning.is_reasoning_end(ids):
        if reasoning.end_token_id is None:
            field = "structured_outputs" if req.structured_outputs is not None else "response_format"
            field = "tool_choice" if plan.structured_outputs is not None else field
            raise bad_request(
                f"{field}: structured output cannot wait for the end of the thinking with the "
                f"{reasoning.name} reasoning parser (no token of the vocabulary ends it)",
                field,
            )
        spec = dataclasses.replace(
            spec,
            reasoning_end_token_id=reasoning.end_token_id,
            reasoning_end_prefix_ids=reasoning.end_prefix_ids,
        )
    if spec is not params.structured_outputs:
        changes["structured_outputs"] = spec
    tool_parser_cls = state.tool_parser_cls
    if plan.choice == "auto" and tool_parser_cls is not None and tool_parser_cls.keeps_special_tokens:
        changes["skip_special_tokens"] = False
    if reasoning is not None and reasoning.keeps_special_tokens:  # its markers are special tokens
        changes["skip_special_tokens"] = False
    return dataclasses.replace(params, **changes) if changes else params


def choice_parser(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, ids: list[int]
) -> ChoiceParser:
    """A new parser for one choice of the request (each choice needs its own: it keeps its stream's
    state); forced under a forced tool choice."""
    tools = make_tool_parser(plan, state.tool_parser_cls, state.engine.tokenizer)
    return ChoiceParser(reasoning_parser(state, req, ids), tools, req, is_forced=plan.is_forced)

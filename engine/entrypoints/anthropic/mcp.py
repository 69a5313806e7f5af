"""Anthropic's MCP connector (beta mcp-client-2025-04-04): a /v1/messages request with `mcp_servers`.

This server lists each MCP server's tools (its tool_configuration applied), offers them to the model
after the request's own tools, and makes the calls the model makes of them (serving/mcp_client.py: the
--tool-server allow-list, the connections, the timeouts). Each call shows as an mcp_tool_use block, its
answer as the mcp_tool_result block after the turn's blocks; the results join the conversation and the
model goes on, up to MAX_MCP_ROUNDS turns (the last may not call). A tool_use block of the request's own
tools ends the message once the turn's MCP calls are made. max_tokens bounds the turns together, usage
sums them (every turn's prompt, every generated token), and the stop reason is the last turn's.

One loop (`McpMessage.events()`) makes the streamed answer and the whole one, so they agree block for
block; a streamed answer starts once the servers are listed and the first turn's first output is read
(message_start carries what the prefix cache held, as vLLM's), so a failure before is still an HTTP error.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from fastapi.responses import StreamingResponse

from xlaserve.entrypoints.anthropic.convert import assistant_history, chat_body, chat_request
from xlaserve.entrypoints.anthropic.output import Piece, stop_reason
from xlaserve.entrypoints.anthropic.prompt import render
from xlaserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    McpToolConfiguration,
    McpToolResultBlock,
    McpToolUseBlock,
    MessagesRequest,
    MessagesResponse,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from xlaserve.entrypoints.anthropic.reading import ChoiceReader
from xlaserve.entrypoints.anthropic.streaming import Blocks, Turn, message_end, message_start, sse
from xlaserve.entrypoints.serving.chat_path import chat_sampling_params, choice_parser
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    drain,
    engine_error,
    new_id,
    run_ahead,
    submit,
)
from xlaserve.entrypoints.serving.errors import APIError, bad_request
from xlaserve.entrypoints.serving.mcp_client import MAX_MCP_ROUNDS, McpClients, McpServer, check_server_url


def _named(error: APIError) -> APIError:
    """`error` with the field it names in its message (Anthropic's errors have no param)."""
    if not error.param or error.message.startswith(error.param):
        return error
    return APIError(error.status_code, f"{error.param}: {error.message}", param=error.param, code=error.code)


def mcp_servers_of(
    req: CountTokensRequest, tool_servers: list[str]
) -> list[tuple[McpServer, McpToolConfiguration]]:
    """The request's enabled MCP servers with their tool_configuration, each checked against
    --tool-server and named once (400s naming the field otherwise); the authorization token goes as a
    Bearer header. A server whose tool_configuration.enabled is false is checked but left out: it is
    never contacted and none of its tools is offered."""
    servers, names = [], set()
    for i, param in enumerate(req.mcp_servers or ()):
        where = f"mcp_servers[{i}]"
        try:
            check_server_url(param.url, tool_servers, f"{where}.url")
        except APIError as e:
            raise _named(e) from None
        if param.name in names:
            raise bad_request(f"{where}.name: the name {param.name!r} is used twice", f"{where}.name")
        names.add(param.name)
        config = param.tool_configuration or McpToolConfiguration()
        if not config.enabled:
            continue
        token = param.authorization_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        servers.append((McpServer(param.name, param.url, headers, where, f"{where}.url"), config))
    return servers


def offered_functions(
    clients: McpClients, configs: list[McpToolConfiguration], req: CountTokensRequest
) -> list[dict]:
    """The listed tools each server's tool_configuration offers, as functions; a name the server does
    not list in allowed_tools is simply not offered, a name that breaks the tool-name pattern is a 424
    (`McpClients.offer`)."""
    taken = {tool.name for tool in req.tools or ()}
    functions = []
    for (server, listed), config in zip(clients.listed, configs):
        allowed = None if config.allowed_tools is None else set(config.allowed_tools)
        for entry in listed:
            if allowed is None or entry.name in allowed:
                where = f"{server.field}.tool_configuration.allowed_tools"
                functions.append(clients.offer(server, entry, taken, where))
    return functions


async def count_with_mcp(state, req: CountTokensRequest) -> int:
    """The first turn's prompt length of a /v1/messages request with these fields: its servers listed
    (the same 400s and 424s) and their tools offered."""
    servers = mcp_servers_of(req, state.tool_servers)
    try:
        async with McpClients([server for server, _ in servers]) as clients:
            body = chat_body(req, offered_functions(clients, [config for _, config in servers], req))
    except APIError as e:
        raise _named(e) from None
    return len((await render(state, req, chat_request(body)))[3])


async def create_with_mcp(state, req: MessagesRequest, raw_request, model: str):
    run = McpMessage(state, req, model, mcp_servers_of(req, state.tool_servers))
    if req.stream:
        events = await run_ahead(run.events())
        return StreamingResponse(_with_error_event(events), media_type="text/event-stream")

    await drain(raw_request, run.events())
    return run.message


async def _with_error_event(events):
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        yield sse("error", engine_error(e).to_anthropic())


def _mcp_id() -> str:
    return new_id("mcptoolu").replace("-", "_")


class _McpCalls:
    """One turn's pieces with the calls of MCP tools as mcp_tool_use pieces, each with an id of its own."""

    def __init__(self, clients: McpClients):
        self.clients = clients
        self.is_mcp = False  # whether the call now streaming is an MCP tool's

    def pieces(self, pieces: list[Piece]) -> list[Piece]:
        out = []
        for piece in pieces:
            if piece.kind == "tool_use" and piece.id is not None:
                server = self.clients.server_of(piece.name)
                self.is_mcp = server is not None
                if self.is_mcp:
                    piece = Piece("mcp_tool_use", piece.text, _mcp_id(), piece.name, server.label)
            elif piece.kind == "tool_use" and self.is_mcp:
                piece = Piece("mcp_tool_use", piece.text)
            out.append(piece)
        return out


class McpMessage:
    """A message whose model may call MCP tools: `events()` (Anthropic's stream events), then `message`."""

    def __init__(
        self,
        state,
        req: MessagesRequest,
        model: str,
        servers: list[tuple[McpServer, McpToolConfiguration]],
    ):
        self.state, self.req, self.model, self.servers = state, req, model, servers
        self.message: MessagesResponse | None = None

    def _start(self, request_id: str, num_prompt_tokens: int):
        """message_start's events, once the first turn's first output says what the prefix cache held."""
        with_details = self.state.enable_prompt_tokens_details
        return lambda first: message_start(
            request_id, self.model, Usage.of(num_prompt_tokens, 0, first, with_details)
        )

    async def events(self):
        state, req = self.state, self.req
        async with contextlib.AsyncExitStack() as stack:
            try:
                clients = await stack.enter_async_context(McpClients([s for s, _ in self.servers]))
                body = chat_body(req, offered_functions(clients, [c for _, c in self.servers], req))
            except APIError as e:
                raise _named(e) from None
            request_id = new_id("msg").replace("-", "_")
            blocks, content, added = Blocks(), [], []
            # A prefill (the request's final assistant message) starts the answer the later turns see.
            prefill = (
                [{"type": "text", "text": body["messages"][-1]["content"]}]
                if body["continue_final_message"]
                else []
            )
            num_prompt = num_generated = 0
            cache = SimpleNamespace(num_cached_tokens=0, num_cache_creation_tokens=0)  # the turns' summed
            with_details = state.enable_prompt_tokens_details
            reason, sequence = "end_turn", None
            for turn in range(MAX_MCP_ROUNDS):
                chat = chat_request(_turn_body(body, added, turn, req.max_tokens - num_generated))
                chat, plan, text, ids, mm_features = await render(state, req, chat)
                max_tokens = chat.max_tokens
                if turn > 0:  # a later turn has what the context leaves, if less
                    max_tokens = min(max_tokens, state.engine.max_model_len - len(ids))
                    if max_tokens <= 0:
                        reason, sequence = "max_tokens", None
                        break
                check_context(state.engine, len(ids), max_tokens, "messages")
                params = chat_sampling_params(state, chat, plan, ids, max_tokens)
                stream = submit(
                    state,
                    ids,
                    params,
                    f"{request_id}-{turn}",
                    stream=True,
                    prompt=text,
                    mm_features=mm_features,
                    cache_salt=chat.cache_salt,
                )
                reader = ChoiceReader(choice_parser(state, chat, plan, ids))
                first = len(blocks.made)
                start = self._start(request_id, len(ids)) if turn == 0 else None
                model_turn = Turn(stream, reader, blocks, _McpCalls(clients).pieces, start)
                async for event in model_turn.events():
                    yield event
                num_generated += model_turn.num_generated
                num_prompt += len(ids)
                cache.num_cached_tokens += model_turn.num_cached_tokens
                cache.num_cache_creation_tokens += model_turn.num_cache_creation_tokens
                # The turn's blocks as the client reads them from the events: streamed or whole, the same.
                turn_blocks = [_BLOCKS[block["type"]].model_validate(block) for block in blocks.made[first:]]
                content += turn_blocks
                has_tool_use = any(b.type == "tool_use" for b in turn_blocks)
                reason, sequence = stop_reason(model_turn.completion, has_tool_use)
                mcp_calls = [b for b in turn_blocks if isinstance(b, McpToolUseBlock)]
                if not mcp_calls or reason == "max_tokens":
                    break
                for call in mcp_calls:
                    outcome = await clients.call(call.name, call.input)
                    result = McpToolResultBlock(
                        tool_use_id=call.id, is_error=outcome.is_error, content=[TextBlock(text=outcome.text)]
                    )
                    content.append(result)
                    for event in blocks.whole(result.model_dump()):
                        yield event
                if has_tool_use:  # the client's own calls end the message
                    break
                # The later turn sees the answer so far as the client would send it back as history.
                added = assistant_history(prefill + [b.model_dump(exclude_none=True) for b in content])
            usage = Usage.of(num_prompt, num_generated, cache, with_details)
            self.message = MessagesResponse(
                id=request_id,
                content=content,
                model=self.model,
                stop_reason=reason,
                stop_sequence=sequence,
                usage=usage,
            )
            for event in message_end(reason, sequence, usage):
                yield event


_BLOCKS = {
    "text": TextBlock,
    "thinking": ThinkingBlock,
    "tool_use": ToolUseBlock,
    "mcp_tool_use": McpToolUseBlock,
}


def _turn_body(body: dict, added: list[dict], turn: int, max_tokens: int) -> dict:
    """The chat request's fields for `turn`: the conversation so far, what is left of max_tokens, and
    after the first turn tool_choice auto (none for the last: it answers in text)."""
    if turn == 0:
        return {**body, "max_tokens": max_tokens}
    messages = body["messages"][:-1] if body["continue_final_message"] else body["messages"]
    return {
        **body,
        "messages": [*messages, *added],
        "max_tokens": max_tokens,
        "tool_choice": "none" if turn == MAX_MCP_ROUNDS - 1 else "auto",
        "add_generation_prompt": True,
        "continue_final_message": False,
    }

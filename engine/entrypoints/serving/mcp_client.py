"""The MCP servers a request names, reached by this server itself (the Responses API's `mcp` tools,
Anthropic's `mcp_servers`): the --tool-server allow-list check, the connections (the official `mcp`
client over streamable HTTP, with the request's headers), listing and calling, each bounded by
MCP_TIMEOUT_S. Each API's shapes (what it calls a server's fields, how calls and results show) stay in
its own folder.

Only the servers named by `--tool-server HOST:PORT` may be reached: any other URL is a 400 before a
connection is made, so no request can make this server fetch an arbitrary URL. A server that cannot be
listed is a 424 (OpenAI's answer), before any answer starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from xlaserve.entrypoints.serving.chat_protocol import FUNCTION_NAME_PATTERN
from xlaserve.entrypoints.serving.errors import APIError, bad_request

logger = logging.getLogger("xlaserve.entrypoints.serving")

MCP_TIMEOUT_S = 30.0
# Model turns of one answer: the last one may not call (tool_choice "none"), so it answers in text.
MAX_MCP_ROUNDS = 4
_MAX_OUTPUT_CHARS = 64 * 1024  # a tool's output fed back to the model (and shown), cut past this
_FUNCTION_NAME = re.compile(FUNCTION_NAME_PATTERN)


def _host_port(url: str) -> str | None:
    """'host:port' of an http(s) URL (the scheme's default port when none is given); None otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return None
    return f"{parts.hostname}:{port}"


def check_server_url(url: str, tool_servers: list[str], where: str) -> None:
    """A 400 naming `where` unless `url` is an http(s) URL of a server --tool-server allows."""
    address = _host_port(url)
    if address is None:
        raise bad_request("must be an http:// or https:// URL with a host", where)
    if address not in tool_servers:
        names = (
            ", ".join(sorted(tool_servers))
            if tool_servers
            else "none (start it with --tool-server HOST:PORT)"
        )
        raise bad_request(
            f"{address} is not an MCP server this server may call; allowed: {names}", where, code="mcp_denied"
        )


@dataclass(frozen=True)
class McpServer:
    """One MCP server of a request: its label, URL and headers (secrets: never shown), and the request's
    field that names it (`tools[0]`, `mcp_servers[0]`) with its URL's (`tools[0].server_url`)."""

    label: str
    url: str
    headers: dict[str, str]
    field: str
    url_field: str


@dataclass
class McpOutcome:
    """A call's result as text; `is_error` when the tool reported an error or the call was not made
    (`is_completed` false: the server could not be reached, or it did not answer in time)."""

    text: str
    is_error: bool = False
    is_completed: bool = True


def _text_of(result) -> str:
    """An MCP tool result's content as text: its text parts joined, any other part as its JSON."""
    pieces = []
    for part in result.content or ():
        text = getattr(part, "text", None)
        pieces.append(text if isinstance(text, str) else part.model_dump_json(exclude_none=True))
    text = "\n".join(pieces)
    return text if len(text) <= _MAX_OUTPUT_CHARS else text[:_MAX_OUTPUT_CHARS] + "..."


def function_of(entry) -> dict:
    """A listed MCP tool as a function the model is offered."""
    function = {"name": entry.name, "parameters": entry.input_schema}
    if entry.description:
        function["description"] = entry.description
    return function


class McpClients:
    """One answer's connections to its MCP servers (async context manager): `listed`, each server with
    its tools (the mcp package's `Tool`s) in the request's order; `offer()` routes a tool's calls to its
    server and `call()` makes them."""

    def __init__(self, servers: list[McpServer]):
        self.servers = servers
        self.listed: list[tuple[McpServer, list]] = []
        self._clients: dict[str, object] = {}  # server label -> its client
        self._routes: dict[str, McpServer] = {}  # an offered tool's name -> its server
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> McpClients:
        if not self.servers:  # every server of the request disabled: nothing to reach
            return self
        try:  # the mcp extra: imported only when a request uses MCP servers
            from mcp import Client
        except ImportError:
            raise APIError(
                400,
                "this server has no MCP client installed (pip install 'xlaserve[mcp]')",
                param=self.servers[0].field,
                code="unsupported",
            ) from None
        try:
            for server in self.servers:
                try:
                    async with asyncio.timeout(MCP_TIMEOUT_S):
                        client = await self._stack.enter_async_context(
                            Client(await self._transport(server), read_timeout_seconds=MCP_TIMEOUT_S)
                        )
                        listed = (await client.list_tools()).tools
                except Exception as e:  # noqa: BLE001 - any failure to reach or list is the same 424
                    logger.warning("MCP server %s (%s) could not be listed: %r", server.label, server.url, e)
                    raise APIError(
                        424,
                        f"the tools of MCP server {server.label!r} could not be listed ({type(e).__name__})",
                        param=server.url_field,
                        code="mcp_list_tools_failed",
                    ) from None
                self._clients[server.label] = client
                self.listed.append((server, listed))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()

    async def _transport(self, server: McpServer):
        """The server's URL, or with the request's headers, a streamable HTTP transport that sends them."""
        if not server.headers:
            return server.url
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client  # the SDK's client and timeouts

        http = await self._stack.enter_async_context(create_mcp_http_client(headers=server.headers))
        return streamable_http_client(server.url, http_client=http)

    def offer(self, server: McpServer, entry, taken: set[str], where: str) -> dict:
        """Route the calls of `server`'s listed tool `entry` to it; its function for the model. A name
        another offered tool, or one of the request's own (`taken`), has is a 400 naming `where` (the
        field that can leave one out); a name outside the function-name pattern (OpenAI's and
        Anthropic's: no prompt here may offer it) is a 424 naming the server and the tool: the request is
        sound but its server lists a tool only the client can leave out, so it is told rather than the
        tool dropped behind its back."""
        if not _FUNCTION_NAME.fullmatch(entry.name):
            shown = repr(entry.name[:64]) + ("..." if len(entry.name) > 64 else "")
            raise APIError(
                424,
                f"the MCP server {server.label!r} lists a tool named {shown}, which breaks "
                f"the tool-name pattern {FUNCTION_NAME_PATTERN}: leave it out with {where}",
                param=server.field,
                code="mcp_invalid_tool_name",
            )
        if entry.name in self._routes or entry.name in taken:
            raise bad_request(
                f"the MCP server {server.label!r} offers a tool named {entry.name!r}, as another tool does: "
                f"leave one out with {where.rsplit('.', 1)[-1]}",
                where,
            )
        self._routes[entry.name] = server
        return function_of(entry)

    def server_of(self, name: str) -> McpServer | None:
        """The MCP server whose offered tool `name` is, or None (a tool of the request's own)."""
        return self._routes.get(name)

    async def call(self, name: str, args: dict) -> McpOutcome:
        """Call the offered tool `name` with `args`: its result, or why it could not be made."""
        server = self._routes[name]
        try:
            async with asyncio.timeout(MCP_TIMEOUT_S):
                result = await self._clients[server.label].call_tool(name, args)
        except Exception as e:  # noqa: BLE001 - the model sees that the call failed, the answer goes on
            logger.warning("MCP tool %s on %s failed: %r", name, server.label, e)
            return McpOutcome(f"the call failed ({type(e).__name__})", is_error=True, is_completed=False)
        text = _text_of(result)
        if result.is_error:
            return McpOutcome(text or "the tool reported an error", is_error=True)
        return McpOutcome(text)

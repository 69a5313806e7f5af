"""Remote MCP tools in the Responses API (`{"type": "mcp", "server_label", "server_url", ...}`): the
server lists each MCP server's tools, offers them to the model as functions, and calls the ones the
model picks with the official `mcp` client over streamable HTTP, feeding the results back.

Only the servers named by `--tool-server HOST:PORT` may be reached: any other `server_url` is a 400
before a connection is made, so no request can make this server fetch an arbitrary URL. Listing and
each call are bounded by MCP_TIMEOUT_S; an MCP server that cannot be listed is a 424 (OpenAI's answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from urllib.parse import urlsplit

from xlaserve.entrypoints.openai.responses_output import McpCallOutput, McpListToolsOutput, McpToolInfo
from xlaserve.entrypoints.openai.responses_protocol import FunctionTool, McpTool, ResponsesRequest
from xlaserve.entrypoints.openai.responses_stream import item_id
from xlaserve.entrypoints.serving.errors import APIError, bad_request

logger = logging.getLogger("xlaserve.entrypoints.openai")

MCP_TIMEOUT_S = 30.0
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")  # an HTTP field name (RFC 9110's token)
_HEADER_VALUE = re.compile(r"[^\r\n\x00]*")  # one line
_MAX_HEADER_VALUE = 8192
# Headers a request's `headers` may not set: the transport's own (framing, the connection, the MCP
# session) and the proxies'.
_TRANSPORT_HEADERS = {
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer",
    "proxy-authorization", "proxy-connection", "content-type", "accept", "accept-encoding",
    "mcp-session-id", "mcp-protocol-version", "last-event-id",
}  # fmt: skip
# Model turns of one response: the last one may not call (tool_choice "none"), so it answers in text.
MAX_MCP_ROUNDS = 4
_MAX_OUTPUT_CHARS = 64 * 1024  # a tool's output fed back to the model (and shown), cut past this


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


def mcp_tools_of(req: ResponsesRequest, tool_servers: list[str]) -> list[tuple[int, McpTool]]:
    """The request's MCP tools with their indices, each checked against --tool-server (a 400 naming
    `tools[i].server_url` otherwise)."""
    found = [(i, tool) for i, tool in enumerate(req.tools or ()) if isinstance(tool, McpTool)]
    if not found:
        return []
    allowed = set(tool_servers)
    labels = set()
    for i, tool in found:
        where = f"tools[{i}].server_url"
        address = _host_port(tool.server_url)
        if address is None:
            raise bad_request("must be an http:// or https:// URL with a host", where)
        if address not in allowed:
            names = ", ".join(sorted(allowed)) if allowed else "none (start it with --tool-server HOST:PORT)"
            raise bad_request(
                f"{address} is not an MCP server this server may call; allowed: {names}",
                where,
                code="mcp_denied",
            )
        if tool.server_label in labels:
            raise bad_request(f"server_label {tool.server_label!r} is used twice", f"tools[{i}].server_label")
        labels.add(tool.server_label)
        _check_headers(tool, f"tools[{i}].headers")
    return found


def _check_headers(tool: McpTool, where: str) -> None:
    for name, value in (tool.headers or {}).items():
        shown = name if len(name) <= 64 else name[:64] + "..."
        if not _HEADER_NAME.fullmatch(name):
            raise bad_request(f"{shown!r} is not an HTTP header name", where)
        if len(value) > _MAX_HEADER_VALUE or not _HEADER_VALUE.fullmatch(value):
            raise bad_request(f"header {shown!r}: one line of at most {_MAX_HEADER_VALUE} characters", where)
        if name.lower() in _TRANSPORT_HEADERS:
            raise bad_request(f"header {shown!r} is the transport's own and may not be set", where)
        if name.lower() == "authorization" and tool.authorization:
            raise bad_request("header 'Authorization' and the authorization field both set it", where)


def _headers(tool: McpTool) -> dict[str, str]:
    headers = dict(tool.headers or {})
    if tool.authorization:
        headers["Authorization"] = f"Bearer {tool.authorization}"
    return headers


def _text_of(result) -> str:
    """An MCP tool result's content as text: its text parts joined, any other part as its JSON."""
    pieces = []
    for part in result.content or ():
        text = getattr(part, "text", None)
        pieces.append(text if isinstance(text, str) else part.model_dump_json(exclude_none=True))
    text = "\n".join(pieces)
    return text if len(text) <= _MAX_OUTPUT_CHARS else text[:_MAX_OUTPUT_CHARS] + "..."


class McpSession:
    """One response's connections to its MCP servers (async context manager): the listed tools as
    `list_items` (mcp_list_tools output items) and `functions` (for the model), and `call()`."""

    def __init__(self, tools: list[tuple[int, McpTool]], request_functions: set[str]):
        self.tools = tools
        self.request_functions = request_functions
        self.list_items: list[McpListToolsOutput] = []
        self.functions: list[dict] = []
        self._routes: dict[str, tuple[str, object]] = {}  # tool name -> (server label, client)
        self._waits: set[str] = set()  # the tools whose calls wait for the client's approval
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> McpSession:
        try:  # the mcp extra: imported only when a request uses MCP tools
            from mcp import Client
        except ImportError:
            raise APIError(
                400,
                "this server has no MCP client installed (pip install 'xlaserve[mcp]')",
                param=f"tools[{self.tools[0][0]}]",
                code="unsupported",
            ) from None
        try:
            for i, tool in self.tools:
                try:
                    async with asyncio.timeout(MCP_TIMEOUT_S):
                        client = await self._stack.enter_async_context(
                            Client(await self._transport(tool), read_timeout_seconds=MCP_TIMEOUT_S)
                        )
                        listed = (await client.list_tools()).tools
                except Exception as e:  # noqa: BLE001 - any failure to reach or list is the same 424
                    logger.warning(
                        "MCP server %s (%s) could not be listed: %r", tool.server_label, tool.server_url, e
                    )
                    raise APIError(
                        424,
                        f"the tools of MCP server {tool.server_label!r} could not be listed "
                        f"({type(e).__name__})",
                        param=f"tools[{i}].server_url",
                        code="mcp_list_tools_failed",
                    ) from None
                self._add(i, tool, client, listed)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _transport(self, tool: McpTool):
        """The server's URL, or with the request's headers, a streamable HTTP transport that sends them."""
        headers = _headers(tool)
        if not headers:
            return tool.server_url
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client  # the SDK's client and timeouts

        http = await self._stack.enter_async_context(create_mcp_http_client(headers=headers))
        return streamable_http_client(tool.server_url, http_client=http)

    def _add(self, i: int, tool: McpTool, client, listed) -> None:
        allowed = None if tool.allowed_tools is None else set(tool.allowed_tools)
        infos = []
        for entry in listed:
            if allowed is not None and entry.name not in allowed:
                continue
            if entry.name in self._routes or entry.name in self.request_functions:
                raise bad_request(
                    f"the MCP server {tool.server_label!r} offers a tool named {entry.name!r}, as another "
                    "tool does: leave one out with allowed_tools",
                    f"tools[{i}].allowed_tools",
                )
            self._routes[entry.name] = (tool.server_label, client)
            if _waits_for_approval(tool.require_approval, entry):
                self._waits.add(entry.name)
            infos.append(
                McpToolInfo(
                    name=entry.name,
                    description=entry.description,
                    input_schema=entry.input_schema,
                    annotations=entry.annotations.model_dump(by_alias=True, exclude_none=True)
                    if entry.annotations is not None
                    else None,
                )
            )
            function = {"name": entry.name, "parameters": entry.input_schema}
            if entry.description:
                function["description"] = entry.description
            self.functions.append(function)
        self.list_items.append(
            McpListToolsOutput(id=item_id("mcpl"), server_label=tool.server_label, tools=infos)
        )

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()

    def label_of(self, name: str) -> str | None:
        """The label of the MCP server whose tool `name` is, or None (a function of the request's own)."""
        route = self._routes.get(name)
        return None if route is None else route[0]

    def needs_approval(self, name: str) -> bool:
        return name in self._waits

    async def call(self, item: McpCallOutput) -> None:
        """Make the call `item` names (its tool, its arguments as JSON text) and write its output, or the
        error, into it."""
        _, client = self._routes[item.name]
        try:
            args = json.loads(item.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            item.error, item.status = "the arguments are not a JSON object", "incomplete"
            return
        try:
            async with asyncio.timeout(MCP_TIMEOUT_S):
                result = await client.call_tool(item.name, args)
        except Exception as e:  # noqa: BLE001 - the model sees that the call failed, the response goes on
            logger.warning("MCP tool %s on %s failed: %r", item.name, item.server_label, e)
            item.error, item.status = f"the call failed ({type(e).__name__})", "incomplete"
            return
        text = _text_of(result)
        if result.is_error:
            item.error = text or "the tool reported an error"
        else:
            item.output = text
        item.status = "completed"


def _waits_for_approval(rule, entry) -> bool:
    """Whether calls of the listed tool `entry` wait for the client under `require_approval` = `rule`:
    "always" all, "never" (or none given) none; a filter: those `always` matches wait, those `never`
    matches do not, and the others wait unless only `always` is given. A filter matches the tools it
    names, and with `read_only: true` those the server marks read-only (`readOnlyHint`)."""
    if rule is None or isinstance(rule, str):
        return rule == "always"

    def matches(selection) -> bool:
        if selection is None:
            return False
        annotations = getattr(entry, "annotations", None)
        read_only = bool(getattr(annotations, "read_only_hint", None))
        return entry.name in (selection.tool_names or ()) or bool(selection.read_only and read_only)

    if matches(rule.always):
        return True
    if matches(rule.never):
        return False
    return not (rule.always is not None and rule.never is None)


def request_function_names(req: ResponsesRequest) -> set[str]:
    return {tool.name for tool in req.tools or () if isinstance(tool, FunctionTool)}

"""Remote MCP tools in the Responses API (`{"type": "mcp", "server_label", "server_url", ...}`): the
server lists each MCP server's tools, offers them to the model as functions, and calls the ones the
model picks (serving/mcp_client.py: the connections, the --tool-server allow-list, the timeouts),
feeding the results back. An MCP server that cannot be listed is a 424 (OpenAI's answer).
"""

from __future__ import annotations

import json
import re

from xlaserve.entrypoints.openai.responses_output import McpCallOutput, McpListToolsOutput, McpToolInfo
from xlaserve.entrypoints.openai.responses_protocol import FunctionTool, McpTool, ResponsesRequest
from xlaserve.entrypoints.openai.responses_stream import item_id
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.mcp_client import McpClients, McpServer, check_server_url

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


def mcp_tools_of(req: ResponsesRequest, tool_servers: list[str]) -> list[tuple[int, McpTool]]:
    """The request's MCP tools with their indices, each checked against --tool-server (a 400 naming
    `tools[i].server_url` otherwise)."""
    found = [(i, tool) for i, tool in enumerate(req.tools or ()) if isinstance(tool, McpTool)]
    if not found:
        return []
    labels = set()
    for i, tool in found:
        check_server_url(tool.server_url, tool_servers, f"tools[{i}].server_url")
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


class McpSession:
    """One response's connections to its MCP servers (async context manager): the listed tools as
    `list_items` (mcp_list_tools output items) and `functions` (for the model), and `call()`."""

    def __init__(self, tools: list[tuple[int, McpTool]], request_functions: set[str]):
        self.tools = tools
        self.request_functions = request_functions
        self.list_items: list[McpListToolsOutput] = []
        self.functions: list[dict] = []
        self._waits: set[str] = set()  # the tools whose calls wait for the client's approval
        self._clients = McpClients(
            [
                McpServer(
                    tool.server_label,
                    tool.server_url,
                    _headers(tool),
                    f"tools[{i}]",
                    f"tools[{i}].server_url",
                )
                for i, tool in tools
            ]
        )

    async def __aenter__(self) -> McpSession:
        await self._clients.__aenter__()
        try:
            for (i, tool), (server, listed) in zip(self.tools, self._clients.listed):
                self._add(i, tool, server, listed)
        except BaseException:
            await self._clients.__aexit__(None, None, None)
            raise
        return self

    def _add(self, i: int, tool: McpTool, server: McpServer, listed) -> None:
        allowed = None if tool.allowed_tools is None else set(tool.allowed_tools)
        infos = []
        for entry in listed:
            if allowed is not None and entry.name not in allowed:
                continue
            self.functions.append(
                self._clients.offer(server, entry, self.request_functions, f"tools[{i}].allowed_tools")
            )
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
        self.list_items.append(
            McpListToolsOutput(id=item_id("mcpl"), server_label=tool.server_label, tools=infos)
        )

    async def __aexit__(self, *exc) -> None:
        await self._clients.__aexit__(*exc)

    def label_of(self, name: str) -> str | None:
        """The label of the MCP server whose tool `name` is, or None (a function of the request's own)."""
        server = self._clients.server_of(name)
        return None if server is None else server.label

    def needs_approval(self, name: str) -> bool:
        return name in self._waits

    async def call(self, item: McpCallOutput) -> None:
        """Make the call `item` names (its tool, its arguments as JSON text) and write its output, or the
        error, into it."""
        try:
            args = json.loads(item.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            item.error, item.status = "the arguments are not a JSON object", "incomplete"
            return
        outcome = await self._clients.call(item.name, args)
        if outcome.is_error:
            item.error = outcome.text
        else:
            item.output = outcome.text
        item.status = "completed" if outcome.is_completed else "incomplete"


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

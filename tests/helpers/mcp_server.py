"""A real MCP server (the `mcp` package's MCPServer over streamable HTTP, uvicorn in a thread) for the
Responses API's MCP tests: its tools are deterministic and it records every call and every HTTP
request, so a test can tell what the xlaserve server asked of it, and that it asked nothing."""

from __future__ import annotations

import socket
import threading
import time


def tide_table(port: str) -> str:
    """High tide times for a port (the tool's answer, also the tests' expectation)."""
    return f"High tide at {port}: 06:12 and 18:40."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_odd_server(app, calls: list):
    """`app` with a second MCP server ("odd") under /odd: its tools break the rules a client of it must
    keep (a name outside Anthropic's tool-name pattern, a name another server's tool has), so a test can
    check the refusals while the allow-listed address stays the one."""
    import contextlib

    from mcp.server.mcpserver import MCPServer
    from starlette.applications import Starlette
    from starlette.routing import Mount

    odd = MCPServer("odd")

    @odd.tool(name="tide.table")
    def dotted_tool(port: str) -> str:
        """A name with a dot: outside ^[a-zA-Z0-9_-]{1,64}$."""
        calls.append(("tide.table", {"port": port}))
        return "never offered"

    @odd.tool(name="tide_table")
    def twin_tool(port: str) -> str:
        """The tides server's tool's name."""
        calls.append(("odd tide_table", {"port": port}))
        return "never offered beside the tides server's"

    @odd.tool(name="moon_phase")
    def moon_phase_tool(day: str) -> str:
        """The moon's phase on a day."""
        calls.append(("moon_phase", {"day": day}))
        return f"Full moon on {day}."

    odd_app = odd.streamable_http_app()

    @contextlib.asynccontextmanager
    async def lifespan(_):
        async with app.router.lifespan_context(app), odd_app.router.lifespan_context(odd_app):
            yield

    return Starlette(routes=[Mount("/odd", app=odd_app), Mount("/", app=app)], lifespan=lifespan)


class ToolServer:
    def __init__(self, name: str = "tides"):
        import uvicorn
        from mcp.server.mcpserver import MCPServer

        self.calls: list[tuple[str, dict]] = []
        self.num_requests = 0
        self.headers: list[dict[str, str]] = []  # each HTTP request's, names in lower case
        server = MCPServer(name)

        from mcp.types import ToolAnnotations

        @server.tool(name="tide_table", annotations=ToolAnnotations(read_only_hint=True))
        def tide_table_tool(port: str) -> str:
            """High tide times for a port."""
            self.calls.append(("tide_table", {"port": port}))
            return tide_table(port)

        @server.tool(name="set_alarm")
        def set_alarm_tool(port: str) -> str:
            """Set an alarm before the next high tide at a port (changes state: not read-only)."""
            self.calls.append(("set_alarm", {"port": port}))
            return f"Alarm set for {port}."

        @server.tool()
        def launch_codes() -> str:
            """Never offered: allowed_tools leaves it out."""
            self.calls.append(("launch_codes", {}))
            return "0000"

        app = _with_odd_server(server.streamable_http_app(), self.calls)

        async def counting(scope, receive, send):
            if scope["type"] == "http":
                self.num_requests += 1
                self.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}/mcp"
        self.odd_url = f"http://{self.address}/odd/mcp"  # another MCP server behind the same address
        config = uvicorn.Config(
            counting, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

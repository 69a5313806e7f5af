"""GET /: the chat playground, one static page (playground.html) streaming from /v1/chat/completions
(under --root-path's prefix when one is given).

Open like /health: the page itself holds nothing; the key a user types in it goes with its requests to
/v1/*, which check it. Off with --disable-playground."""

from __future__ import annotations

import functools
import html
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

# No frames from other origins, and no script, style or connection outside this one (the page has no
# external assets, so a policy this strict costs it nothing).
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


@functools.cache
def playground_html() -> str:
    return resources.files("xlaserve.entrypoints").joinpath("playground.html").read_text(encoding="utf-8")


def add_playground_route(app: FastAPI) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground(request: Request) -> HTMLResponse:
        # Behind a proxy's prefix (--root-path) the page's calls go under that prefix too.
        root_path = html.escape(request.scope.get("root_path", ""), quote=True)
        return HTMLResponse(playground_html().replace("{{root_path}}", root_path, 1), headers=_HEADERS)
